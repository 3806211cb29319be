"""The handlers of events addressed to a KV cache group other than 0 (a hybrid cache:
group 1 holds the sliding-window layers' blocks): the same meanings as group 0's, over
the group's own pool (``schema.group_pool(tier, group)``) and the sequence's table in that
group (``SeqState.group_tables[group]``).

Invariants they keep, beyond group 0's:
- a sequence's table of group g points at blocks of pool ``group_pool(seq tier, g)``;
- an empty table is absent from ``group_tables`` (``canonical()`` omits it too);
- ``group_tables`` and its lists are replaced, never mutated in place (the undo journal
  restores them by keeping the old objects);
- ``release`` (group > 0 only) lets go of a table's oldest blocks, in order.

A mixin of ``KVState``: group 0's handlers (``state_handlers``) hand a grouped event here.
"""

from __future__ import annotations

from typing import Any

from kvscope.engine.events import schema as S
from kvscope.engine.events.schema import ProtocolError
from kvscope.engine.events.state_blocks import BlockWrites
from kvscope.engine.events.state_store import SeqState, TierState, unpack_ids


class GroupHandlers(BlockWrites):
    """One method per kind that takes a ``group`` field (see the module docstring)."""

    @staticmethod
    def _group_id(ev: dict[str, Any]) -> int:
        """The event's cache group: an int in [0, 64), refused otherwise."""
        g = ev["group"]
        if type(g) is not int or not 0 <= g < 64:
            raise ProtocolError(f"{ev.get('kind')}: bad cache group {g!r}")
        return g

    def _group_of(self, ev: dict[str, Any]) -> tuple[TierState, int, SeqState, list[int]]:
        g = self._group_id(ev)
        t = self._tier(S.group_pool(ev["tier"], g))
        s, blocks = self._seq(ev["seq"]), unpack_ids(ev["blocks"])
        t.check_ids(blocks)
        return t, g, s, blocks

    def _group_alloc(self, ev: dict[str, Any]) -> None:
        t, g, s, blocks = self._group_of(ev)
        self._free_blocks(t, blocks, "alloc")
        self._add_refs(t, blocks, s.owner_id, 1)
        s.group_tables = {**s.group_tables, g: s.group_tables.get(g, []) + blocks}

    def _group_hit(self, ev: dict[str, Any]) -> None:
        t, g, s, blocks = self._group_of(ev)
        hashed = t.hashed_c.py
        for b in blocks:
            if not hashed[b]:
                raise ProtocolError(f"hit: {t.name} block {b} is not cached")
        self._add_refs(t, blocks, s.owner_id, 1)
        s.group_tables = {**s.group_tables, g: s.group_tables.get(g, []) + blocks}

    def _group_free(self, ev: dict[str, Any]) -> None:
        t, g, s, blocks = self._group_of(ev)
        if blocks != s.group_tables.get(g, []):
            raise ProtocolError(f"free: {s.seq_id} does not hold exactly {t.name} {blocks}")
        self._add_refs(t, blocks, s.owner_id, -1)
        s.group_tables = {k: v for k, v in s.group_tables.items() if k != g}

    def _release_ev(self, ev: dict[str, Any]) -> None:
        t, g, s, blocks = self._group_of(ev)
        table = s.group_tables.get(g, [])
        if not g or table[:len(blocks)] != blocks:
            raise ProtocolError(f"release: {blocks} are not the oldest {t.name} blocks of "
                                f"{s.seq_id}")
        self._add_refs(t, blocks, s.owner_id, -1)
        rest = table[len(blocks):]
        s.group_tables = {**{k: v for k, v in s.group_tables.items() if k != g},
                          **({g: rest} if rest else {})}

    def _group_fork(self, ev: dict[str, Any]) -> None:
        t, g, s, blocks = self._group_of(ev)
        parent = self._seq(ev["parent"])
        if blocks != parent.group_tables.get(g, []) or s.group_tables.get(g):
            raise ProtocolError(f"fork: {s.seq_id} cannot share {parent.seq_id}'s {t.name} "
                                "blocks")
        self._add_refs(t, blocks, s.owner_id, 1)
        s.group_tables = {**s.group_tables, g: list(blocks)}

    def _group_cow(self, ev: dict[str, Any]) -> None:
        g = self._group_id(ev)
        t, s = self._tier(S.group_pool(ev["tier"], g)), self._seq(ev["seq"])
        logical, src, dst = unpack_ids(ev["logical"]), unpack_ids(ev["src"]), unpack_ids(ev["dst"])
        t.check_ids(src)
        t.check_ids(dst)
        if not len(logical) == len(src) == len(dst):
            raise ProtocolError("cow: logical, src and dst differ in length")
        table = list(s.group_tables.get(g, []))
        for i, a, b in zip(logical, src, dst, strict=True):
            if not 0 <= i < len(table) or table[i] != a:
                raise ProtocolError(f"cow: {s.seq_id}[{i}] of {t.name} is not block {a}")
            self._free_blocks(t, [b], "cow")
            self._add_refs(t, [a], s.owner_id, -1)
            self._add_refs(t, [b], s.owner_id, 1)
            table[i] = b
        s.group_tables = {**s.group_tables, g: table}

    def _group_move(self, ev: dict[str, Any], src_tier: str, dst_tier: str) -> None:
        """swap_out/swap_in of a group other than 0: the sequence's table of that group
        moves between the group's pools of the two tiers."""
        g = self._group_id(ev)
        s = self._seq(ev["seq"])
        a, b = self._tier(S.group_pool(src_tier, g)), self._tier(S.group_pool(dst_tier, g))
        src, dst = unpack_ids(ev["src"]), unpack_ids(ev["dst"])
        a.check_ids(src)
        b.check_ids(dst)
        if src != s.group_tables.get(g, []) or len(dst) != len(src):
            raise ProtocolError(f"{ev['kind']}: {s.seq_id} does not hold {a.name} {src}")
        self._add_refs(a, src, s.owner_id, -1)
        self._add_refs(b, dst, s.owner_id, 1)
        s.group_tables = {**{k: v for k, v in s.group_tables.items() if k != g},
                          **({g: list(dst)} if dst else {})}

