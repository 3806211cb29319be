"""The meaning of each event kind: one handler per kind, and ``HANDLERS``, the dispatch
from a kind's wire name to its handler (``KVState._apply_events`` calls them in order).

A handler checks what its event may do before it writes the blocks it touches (cow's
pairs are checked one after another, each against the state its predecessors left); a
refusal is a ProtocolError naming the event, and the undo journal takes back whatever
the refused batch wrote. Together the handlers keep ``engine.events.state``'s
invariants: a sequence's table lives in one tier and points at held blocks of it; a
block's ref count equals the number of table entries pointing at it; only a free block
(ref 0, no hash) is allocated, and only an unheld cached block is evicted. An event with
a ``group`` (a cache group other than 0) goes to its kind's group handler
(``state_groups``).

A mixin of ``KVState``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvscope.engine.events import schema as S
from kvscope.engine.events.schema import ProtocolError
from kvscope.engine.events.state_groups import GroupHandlers
from kvscope.engine.events.state_store import (
    MAX_SEQS,
    MAX_TIER_BLOCKS,
    SMALL_IDS,
    SeqState,
    TierState,
    format_code,
    seq_owner_id,
    unpack_ids,
)


class EventHandlers(GroupHandlers):
    """One method per event kind (see the module docstring)."""

    seqs: dict[str, SeqState]
    _geometry_of: Any  # KVState's: the batch whose geometry is still to be checked
    _check_geometry: Callable[[Any], None]

    def _tier_init(self, ev: dict[str, Any]) -> None:
        batch = self._geometry_of
        if batch is not None:  # the batch's first tier_init: its whole geometry first
            self._geometry_of = None
            self._check_geometry(batch)
        name = ev["tier"]
        if name not in S.TIERS:
            raise ProtocolError(f"unknown tier {name!r}")
        if "group" in ev:
            name = S.group_pool(name, self._group_id(ev))
        n, bs = int(ev["num_blocks"]), int(ev["block_size"])
        if n < 0 or bs < 1 or n > MAX_TIER_BLOCKS or bs >= 1 << 31:
            raise ProtocolError(f"tier {name}: bad size {n} blocks x {bs} tokens (a mirror "
                                f"holds at most {MAX_TIER_BLOCKS} blocks a tier)")
        self._save_item(self.tiers, name)
        self.tiers[name] = TierState(name, n, bs, str(ev.get("format", "auto")))

    def _seq_add(self, ev: dict[str, Any]) -> None:
        sid = ev["seq"]
        if not isinstance(sid, str) or sid in self.seqs:
            raise ProtocolError(f"seq_add: bad or duplicate sequence id {sid!r}")
        if len(self.seqs) >= MAX_SEQS:
            raise ProtocolError(f"seq_add: {sid!r} would pass the mirror's limit of "
                                f"{MAX_SEQS} live sequences; batch refused")
        self._save_item(self.seqs, sid)
        self._batch_dirty.add(sid)
        self.seqs[sid] = SeqState(
            seq_id=sid, prompt_tokens=int(ev.get("prompt_tokens", 0)),
            priority=int(ev.get("priority", 0)), parent=ev.get("parent"),
            owner_id=seq_owner_id(sid),
        )

    def _seq_start(self, ev: dict[str, Any]) -> None:
        self._seq(ev["seq"]).status = "running"

    def _alloc(self, ev: dict[str, Any]) -> None:
        if ev.get("group"):
            return self._group_alloc(ev)
        t, s, blocks = self._tier(ev["tier"]), self._seq(ev["seq"]), unpack_ids(ev["blocks"])
        t.check_ids(blocks)
        self._require_table_tier(s, t)
        self._free_blocks(t, blocks, "alloc")
        self._add_refs(t, blocks, s.owner_id, 1)
        s.block_table.extend(blocks)

    def _hit(self, ev: dict[str, Any]) -> None:
        if ev.get("group"):
            return self._group_hit(ev)
        t, s, blocks = self._tier(ev["tier"]), self._seq(ev["seq"]), unpack_ids(ev["blocks"])
        t.check_ids(blocks)
        self._require_table_tier(s, t)
        hashed = t.hashed_c.py
        for b in blocks:
            if not hashed[b]:
                raise ProtocolError(f"hit: {t.name} block {b} is not cached")
        self._add_refs(t, blocks, s.owner_id, 1)
        s.block_table.extend(blocks)
        s.hit_tokens += int(ev.get("tokens", 0))

    def _pool_of(self, ev: dict[str, Any]) -> TierState:
        """The pool an index event (store, evict) addresses: a tier, or a group's pool."""
        if ev.get("group"):
            return self._tier(S.group_pool(ev["tier"], self._group_id(ev)))
        return self._tier(ev["tier"])

    def _store(self, ev: dict[str, Any]) -> None:
        t, blocks, hashes = self._pool_of(ev), unpack_ids(ev["blocks"]), ev["hashes"]
        t.check_ids(blocks)
        hashes = list(map(int, hashes))
        if len(blocks) != len(hashes):
            raise ProtocolError("store: blocks and hashes differ in length")
        self._set_hashes(t, blocks, hashes)

    def _evict(self, ev: dict[str, Any]) -> None:
        t, blocks = self._pool_of(ev), unpack_ids(ev["blocks"])
        t.check_ids(blocks)
        ref, hashed = t.ref_c.py, t.hashed_c.py
        if len(blocks) > SMALL_IDS:
            idx = self._idx(blocks)
            bad = np.flatnonzero((t.ref_c.np[idx] != 0) | (t.hashed_c.np[idx] == 0))
            if bad.size:
                raise ProtocolError(f"evict: {t.name} block {blocks[bad[0]]} is not a cached "
                                    "free block")
        else:
            for b in blocks:
                if ref[b] or not hashed[b]:
                    raise ProtocolError(f"evict: {t.name} block {b} is not a cached free block")
        t.mark(blocks)
        self._save3(t.hashed_c, t.hash_c, t.touched_c, blocks)
        if t.big_hashes:
            self._save_big_hashes(t)
            for b in blocks:
                t.big_hashes.pop(b, None)
        if len(blocks) > SMALL_IDS:
            idx = self._idx(blocks)
            t.hashed_c.np[idx] = 0
            t.hash_c.np[idx] = 0
            t.touched_c.np[idx] = self._cur_step
            self._drop_formats(t, blocks)
            return
        hv, tch, step = t.hash_c.py, t.touched_c.py, self._cur_step
        for b in blocks:
            hashed[b] = 0
            hv[b] = 0
            tch[b] = step
        self._drop_formats(t, blocks)

    def _free(self, ev: dict[str, Any]) -> None:
        if ev.get("group"):
            return self._group_free(ev)
        t, s, blocks = self._tier(ev["tier"]), self._seq(ev["seq"]), unpack_ids(ev["blocks"])
        if s.tier != t.name or blocks != s.block_table:
            raise ProtocolError(f"free: {s.seq_id} does not hold exactly {t.name} {blocks}")
        self._add_refs(t, blocks, s.owner_id, -1)
        s.block_table = []
        s.num_tokens = 0

    def _fork(self, ev: dict[str, Any]) -> None:
        if ev.get("group"):
            return self._group_fork(ev)
        t, s, parent = self._tier(ev["tier"]), self._seq(ev["seq"]), self._seq(ev["parent"])
        blocks = unpack_ids(ev["blocks"])
        if parent.tier != t.name or blocks != parent.block_table or s.block_table:
            raise ProtocolError(f"fork: {s.seq_id} cannot share {parent.seq_id}'s blocks")
        s.tier = t.name
        self._add_refs(t, blocks, s.owner_id, 1)
        s.block_table = list(blocks)
        s.num_tokens = parent.num_tokens

    def _cow(self, ev: dict[str, Any]) -> None:
        if ev.get("group"):
            return self._group_cow(ev)
        t, s = self._tier(ev["tier"]), self._seq(ev["seq"])
        logical, src, dst = ev["logical"], unpack_ids(ev["src"]), unpack_ids(ev["dst"])
        logical = unpack_ids(logical)
        t.check_ids(src)
        t.check_ids(dst)
        if not len(logical) == len(src) == len(dst):
            raise ProtocolError("cow: logical, src and dst differ in length")
        for i, a, b in zip(logical, src, dst, strict=True):
            if not 0 <= i < len(s.block_table) or s.block_table[i] != a:
                raise ProtocolError(f"cow: {s.seq_id}[{i}] is not block {a}")
            self._free_blocks(t, [b], "cow")  # checked per pair: dst may repeat a src
            self._add_refs(t, [a], s.owner_id, -1)
            self._add_refs(t, [b], s.owner_id, 1)
            self._save_entry(s.block_table, i)
            s.block_table[i] = b

    def _seq_tokens(self, ev: dict[str, Any]) -> None:
        seqs, counts = ev["seqs"], list(map(int, ev["num_tokens"]))
        if type(seqs) is not list or len(seqs) != len(counts):
            raise ProtocolError("seq_tokens: seqs and num_tokens differ in length")
        # the hot path of every decode step: one undo entry for all, not a copy per seq
        table = self.seqs
        try:
            objs = list(map(table.__getitem__, seqs))
            self._batch_dirty.update(seqs)
        except (KeyError, TypeError):
            missing = next(sid for sid in seqs if not isinstance(sid, str) or sid not in table)
            raise ProtocolError(f"unknown sequence {missing!r}") from None
        self._save_tokens(objs)
        for s, n in zip(objs, counts, strict=True):
            s.num_tokens = n

    def _seq_preempt(self, ev: dict[str, Any]) -> None:
        s, mode = self._seq(ev["seq"]), ev["mode"]
        if mode not in S.PREEMPT_MODES:
            raise ProtocolError(f"seq_preempt: unknown mode {mode!r}")
        s.status = "swapped" if mode == "swap" else "waiting"
        s.preemptions += 1

    def _seq_resume(self, ev: dict[str, Any]) -> None:
        self._seq(ev["seq"]).status = "running"

    def _seq_finish(self, ev: dict[str, Any]) -> None:
        s = self._seq(ev["seq"])
        if s.block_table:
            raise ProtocolError(f"seq_finish: {s.seq_id} still holds blocks (free it first)")
        if self._seq_order is None:
            self._seq_order = list(self.seqs)
        self._save_item(self.seqs, s.seq_id)
        del self.seqs[s.seq_id]

    def _move(self, ev: dict[str, Any], src_tier: str, dst_tier: str) -> None:
        s = self._seq(ev["seq"])
        a, b = self._tier(src_tier), self._tier(dst_tier)
        src, dst = unpack_ids(ev["src"]), unpack_ids(ev["dst"])
        a.check_ids(src)
        b.check_ids(dst)
        if s.tier != src_tier or src != s.block_table or len(dst) != len(src):
            raise ProtocolError(f"{ev['kind']}: {s.seq_id} does not hold {src_tier} {src}")
        self._add_refs(a, src, s.owner_id, -1)
        self._add_refs(b, dst, s.owner_id, 1)
        s.tier, s.block_table = dst_tier, list(dst)

    def _swap_out(self, ev: dict[str, Any]) -> None:
        if ev.get("group"):
            return self._group_move(ev, "gpu", "cpu")
        self._move(ev, "gpu", "cpu")

    def _swap_in(self, ev: dict[str, Any]) -> None:
        if ev.get("group"):
            return self._group_move(ev, "cpu", "gpu")
        self._move(ev, "cpu", "gpu")

    def _offload(self, ev: dict[str, Any]) -> None:
        host = self._tier(S.group_pool("cpu", self._group_id(ev)) if ev.get("group")
                          else "cpu")
        dst, hashes = unpack_ids(ev["dst"]), [int(h) for h in ev["hashes"]]
        host.check_ids(dst)
        if len(dst) != len(hashes):
            raise ProtocolError("offload: dst and hashes differ in length")
        ref = host.ref_c.py
        for b in dst:
            if ref[b]:
                raise ProtocolError(f"offload: host block {b} is in use")
        self._set_hashes(host, dst, hashes)

    def _host_hit(self, ev: dict[str, Any]) -> None:
        host, dev, s = self._tier("cpu"), self._tier("gpu"), self._seq(ev["seq"])
        src, dst = unpack_ids(ev["src"]), unpack_ids(ev["dst"])
        host.check_ids(src)
        dev.check_ids(dst)
        self._require_table_tier(s, dev)
        if len(src) != len(dst):
            raise ProtocolError("host_hit: src and dst differ in length")
        hashed = host.hashed_c.py
        for a in src:
            if not hashed[a]:
                raise ProtocolError(f"host_hit: host block {a} is not cached")
        self._free_blocks(dev, dst, "host_hit")
        self._add_refs(dev, dst, s.owner_id, 1)
        self._set_hashes(dev, dst, [host.hash_value(a) for a in src])
        s.block_table.extend(dst)
        s.hit_tokens += int(ev.get("tokens", 0))

    def _disk_store(self, ev: dict[str, Any]) -> None:
        host, disk = self._tier("cpu"), self._tier("disk")
        src, dst = unpack_ids(ev["src"]), unpack_ids(ev["dst"])
        hashes = [int(h) for h in ev["hashes"]]
        host.check_ids(src)
        disk.check_ids(dst)
        if not len(src) == len(dst) == len(hashes):
            raise ProtocolError("disk_store: src, dst and hashes differ in length")
        self._free_blocks(disk, dst, "disk_store")
        self._set_hashes(disk, dst, hashes)

    def _cached_on_disk(self, ev: dict[str, Any], what: str) -> tuple[TierState, list[int]]:
        disk, src = self._tier("disk"), unpack_ids(ev["src"])
        disk.check_ids(src)
        hashed = disk.hashed_c.py
        for b in src:
            if not hashed[b]:
                raise ProtocolError(f"{what}: disk block {b} is not cached")
        return disk, src

    def _prefetch_ev(self, ev: dict[str, Any]) -> None:
        self._seq(ev["seq"])
        self._cached_on_disk(ev, "prefetch")  # nothing changes until they arrive

    def _disk_load(self, ev: dict[str, Any]) -> None:
        # the sequence may have finished meanwhile: what arrives still becomes host cache
        disk, src = self._cached_on_disk(ev, "disk_load")
        host, dst = self._tier("cpu"), unpack_ids(ev["dst"])
        host.check_ids(dst)
        if len(src) != len(dst):
            raise ProtocolError("disk_load: src and dst differ in length")
        self._free_blocks(host, dst, "disk_load")
        self._set_hashes(host, dst, [disk.hash_value(b) for b in src])

    def _quantize(self, ev: dict[str, Any]) -> None:
        """Demotion: the blocks' page format changes in place (refs, hashes and block
        tables are unchanged). Only blocks holding K/V (in use or cached) can change; a
        block that becomes free reverts to the tier's format (``_drop_formats``)."""
        t, blocks, fmt = self._tier(ev["tier"]), unpack_ids(ev["blocks"]), ev["format"]
        if not isinstance(fmt, str) or not fmt:
            raise ProtocolError(f"quantize: format {fmt!r} is not a name")
        t.check_ids(blocks)
        ref, hashed = t.ref_c.py, t.hashed_c.py
        for b in blocks:  # only a page holding K/V (in use or cached) has a format
            if not ref[b] and not hashed[b]:
                raise ProtocolError(f"quantize: {t.name} block {b} is free")
        if fmt not in t.format_names:
            self._save_formats(t)
        code = format_code(t, fmt)
        t.mark(blocks)
        for col in (t.fmt_c, t.touched_c):
            self._save(col, blocks)
        if len(blocks) <= SMALL_IDS:
            fc, tch, step = t.fmt_c.py, t.touched_c.py, self._cur_step
            for b in blocks:
                fc[b] = code
                tch[b] = step
        else:
            idx = self._idx(blocks)
            t.fmt_c.np[idx] = code
            t.touched_c.np[idx] = self._cur_step


# a kind's wire name -> its handler (KVState._apply_events counts and skips any other)
HANDLERS: dict[str, Callable[[Any, dict[str, Any]], None]] = {
    S.TIER_INIT: EventHandlers._tier_init,
    S.RELEASE: EventHandlers._release_ev,
    S.SEQ_ADD: EventHandlers._seq_add,
    S.SEQ_START: EventHandlers._seq_start,
    S.ALLOC: EventHandlers._alloc,
    S.HIT: EventHandlers._hit,
    S.STORE: EventHandlers._store,
    S.EVICT: EventHandlers._evict,
    S.FREE: EventHandlers._free,
    S.FORK: EventHandlers._fork,
    S.COW: EventHandlers._cow,
    S.SEQ_TOKENS: EventHandlers._seq_tokens,
    S.SEQ_PREEMPT: EventHandlers._seq_preempt,
    S.SEQ_RESUME: EventHandlers._seq_resume,
    S.SEQ_FINISH: EventHandlers._seq_finish,
    S.SWAP_OUT: EventHandlers._swap_out,
    S.SWAP_IN: EventHandlers._swap_in,
    S.OFFLOAD: EventHandlers._offload,
    S.HOST_HIT: EventHandlers._host_hit,
    S.QUANTIZE: EventHandlers._quantize,
    S.DISK_STORE: EventHandlers._disk_store,
    S.PREFETCH: EventHandlers._prefetch_ev,
    S.DISK_LOAD: EventHandlers._disk_load,
}
