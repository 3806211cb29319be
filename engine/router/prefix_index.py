"""PrefixIndex: which block hashes one replica's prefix cache holds, kept from its events.

The meaning of each event stays in one place (``KVState.apply``): the index never
interprets an event itself. After the subscriber has applied a batch to its mirror, the
index re-reads from the mirror the hash of every block the batch's events name (their
``blocks``/``src``/``dst`` lists, in every tier), so a ``store`` adds a hash, an
``evict`` removes one, an ``offload`` adds a host copy, a ``host_hit`` a gpu copy, and a
kind added later is covered as long as it names its blocks. A snapshot (join, restart,
resync) or a ``tier_init`` rebuilds the index from the whole mirror.

Invariant (the tests check it against the mirror after every run): ``count[h]`` is the
number of blocks, over all tiers, whose mirror hash is ``h``; ``by_block[(tier, b)]`` is
the hash the index believes block ``b`` holds.

Bounded: the index holds at most ``MAX_INDEXED`` blocks (the mirror may hold up to
``MAX_TOTAL_BLOCKS``, 8M, hashed: ~2 GB as these dicts). Past it the index is emptied
and ``overflowed`` says why: the replica then matches no prefix (the router routes it by
load) until its mirror's cached blocks are within the limit again, checked at each
batch, when the index is rebuilt from the mirror.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from kvscope.engine.cache.hashing import chain_hashes
from kvscope.engine.events import columns as C
from kvscope.engine.events import schema as S
from kvscope.engine.events.columns import StepColumns
from kvscope.engine.events.schema import ProtocolError
from kvscope.engine.events.state import unpack_ids

_BLOCK_LISTS = ("blocks", "src", "dst")
# The most blocks one replica's index holds (a dict entry with its key tuple and a
# Counter entry: ~250 bytes, ~250 MiB at the cap). A replica's cache is far smaller.
MAX_INDEXED = 1 << 20


def _cached_blocks(state: Any) -> int:
    """How many blocks of the mirror hold a hash, over all tiers (one numpy pass)."""
    return sum(int(np.count_nonzero(t.hashed_c.np)) for t in state.tiers.values())


class PrefixIndex:
    """Hash -> number of cached copies, for one replica. Not thread-safe: the caller holds
    the subscriber's lock (updates run under it; readers take it)."""

    def __init__(self) -> None:
        self.count: Counter[int] = Counter()
        self.by_block: dict[tuple[str, int], int] = {}
        self.overflowed: str | None = None  # why the index is off (None: it is on)

    def __len__(self) -> int:
        return len(self.by_block)

    def rebuild(self, state: Any) -> None:
        """Forget everything and read every cached block's hash from the mirror (or,
        past ``MAX_INDEXED`` of them, stay empty and say so in ``overflowed``)."""
        self.count.clear()
        self.by_block.clear()
        n = _cached_blocks(state)
        if n > MAX_INDEXED:
            self._overflow(n)
            return
        self.overflowed = None
        for name, tier in state.tiers.items():
            for b, h in tier.hashes.items():
                self.by_block[(name, b)] = h
                self.count[h] += 1

    def on_batch(self, batch: dict[str, Any], state: Any) -> None:
        """Re-read the blocks this (already applied) batch touched. A batch holding
        ``columns`` (protocol 3, decoded) is read from them: its block ids are one array,
        each block re-read once (``_on_columns``); the same result as from its events."""
        if self.overflowed is not None:
            if _cached_blocks(state) <= MAX_INDEXED:
                self.rebuild(state)
            return
        cols = batch.get("columns")
        if isinstance(cols, StepColumns):
            self._on_columns(cols, state)
            return
        events = batch.get("events")
        if not isinstance(events, list):
            self.rebuild(state)
            return
        for ev in events:
            if not isinstance(ev, dict) or ev.get("kind") == S.TIER_INIT:
                self.rebuild(state)
                return
            for key in _BLOCK_LISTS:
                if key not in ev:
                    continue
                try:  # a list (protocol 1) or packed int32 bytes (protocol 2)
                    blocks = unpack_ids(ev[key])
                except ProtocolError:
                    self.rebuild(state)
                    return
                if blocks:
                    for name, tier in state.tiers.items():
                        for b in blocks:
                            if isinstance(b, int) and 0 <= b < tier.num_blocks:
                                self._sync(name, b, tier.hashes.get(b))

    def _on_columns(self, cols: StepColumns, state: Any) -> None:
        """``on_batch`` of a batch in columns: the hot events' ids (but seq_tokens', which
        index sequence names) and the other events' block lists, deduplicated, re-read
        from the mirror's hash columns in every tier, as the per-event path does."""
        parts = [cols.ids[cols.kind[np.repeat(np.arange(len(cols.kind)), np.diff(cols.off))]
                          != C.SEQ_TOKENS]]
        for ev in cols.others:
            if not isinstance(ev, dict) or ev.get("kind") == S.TIER_INIT:
                self.rebuild(state)
                return
            for key in _BLOCK_LISTS:
                if key in ev:
                    try:
                        ids = unpack_ids(ev[key])
                    except ProtocolError:
                        self.rebuild(state)
                        return
                    parts.append(np.array([b for b in ids if isinstance(b, int)],
                                          dtype=np.int64))
        blocks = np.unique(np.concatenate(parts).astype(np.int64, copy=False))
        for name, tier in state.tiers.items():
            b = blocks[(blocks >= 0) & (blocks < tier.num_blocks)]
            hashed, values, big = tier.hashed_c.np[b], tier.hash_c.np[b], tier.big_hashes
            for blk, held, h in zip(b.tolist(), hashed.tolist(), values.tolist(), strict=True):
                self._sync(name, blk, (big.get(blk, h) if big else h) if held else None)

    def _sync(self, tier: str, block: int, h: int | None) -> None:
        if self.overflowed is not None:  # off since an earlier block of this batch
            return
        key = (tier, block)
        old = self.by_block.get(key)
        if old == h:
            return
        if old is not None:
            self.count[old] -= 1
            if self.count[old] <= 0:
                del self.count[old]
            del self.by_block[key]
        if h is not None:
            if len(self.by_block) >= MAX_INDEXED:
                self._overflow(len(self.by_block) + 1)
                return
            self.by_block[key] = h
            self.count[h] += 1

    def _overflow(self, n: int) -> None:
        self.count.clear()
        self.by_block.clear()
        self.overflowed = (f"prefix index off: {n} cached blocks, past its limit of "
                           f"{MAX_INDEXED}; this replica is routed by load only")

    def matched_blocks(self, chain: list[int]) -> int:
        """How many leading hashes of a prompt's block chain this replica holds."""
        n = 0
        for h in chain:
            if h not in self.count:
                break
            n += 1
        return n


def prompt_chain(token_ids: list[int], block_size: int) -> list[int]:
    """The block hashes the engine would look up for this prompt: every full block of all
    but the last token (a full hit leaves the last token to compute, as in the engine's
    ``match_prefix``), unsalted."""
    return chain_hashes(token_ids[:max(len(token_ids) - 1, 0)], block_size)
