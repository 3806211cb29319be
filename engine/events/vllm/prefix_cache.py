"""VllmPrefixCache: the prefix-cache index a vLLM-format stream describes, per medium.

What vLLM's contract carries, and therefore all this can show: which block hashes each
medium (GPU, CPU, STORAGE) holds, since when, their parent chain and token count, and the
store/remove timeline. What it does NOT carry (NOT_PUBLISHED): block ids and allocation,
block tables (which request uses which block), ref counts, free blocks, preemption,
swaps, and the cache size, so usage in percent is unknown.

Meaning of each event (vLLM's):
    BlockStored       the hashes enter ``medium``; the first one's parent is
                      ``parent_block_hash`` and each next one's is the previous hash
    BlockRemoved      the hashes leave ``medium``
    AllBlocksCleared  every medium is emptied
Groups: a hybrid model's vLLM (KV cache groups: full attention, sliding window) stores
and removes each group's blocks separately, naming it in ``group_idx``. Group 0 (or none
named) is the medium itself; group g > 0 is its own index under ``"<medium>/<g>"``
(``engine.events.schema.group_pool``, kvscope's name for a group's pool), so one group's
removal never takes a hash out of another's.
Copies: vLLM caches identical content computed by two requests at once in two blocks
under one hash, and sends BlockStored for each and later BlockRemoved for each (seen in
the committed vLLM 0.32 capture). So a hash is held while stores outnumber removals
(``CachedBlock.copies``); ``duplicates`` counts such second stores. A removal of a hash
the medium does not hold is counted (``unknown_removed``), never fatal: a consumer that
joined late sees those.
Bounded: the index holds at most ``MAX_HASHES`` hashes over all media; a batch whose
stores would pass it (counted before anything is applied, each store as a new hash, a
clear restarting the count) is refused whole with ``IndexFull``, the index as it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvscope.engine.events.schema import group_pool
from kvscope.engine.events.vllm import kv_events_wire as W

NOT_PUBLISHED = ("vLLM's KV events publish the prefix-cache index only: no block ids, "
                 "allocation, block tables, ref counts, preemption or swaps, and no cache "
                 "size (usage % is unknown).")


# The most hashes the index holds over all media (a CachedBlock and its dict entry are
# ~200 bytes: ~400 MiB at the cap). A vLLM cache of 2M blocks a medium is already huge;
# a publisher that stores hashes without end must not grow a reader without end.
MAX_HASHES = 1 << 21


class IndexFull(ValueError):
    """A batch whose stores would take the index past ``MAX_HASHES``: not applied."""


@dataclass
class CachedBlock:
    parent: int | bytes | None
    num_tokens: int
    stored_ts: float
    copies: int = 1  # blocks holding this content (vLLM does not deduplicate)


@dataclass
class TimelinePoint:
    ts: float
    stored: int  # hashes stored in this batch (all media)
    removed: int
    cleared: bool
    held: dict[str, int]  # hashes held per medium after the batch


def _medium(ev: dict[str, Any]) -> str:
    """The index an event addresses: its medium, and its KV cache group when not 0."""
    group = ev.get("group_idx")
    medium = str(ev.get("medium") or W.MEDIUM_GPU)
    return group_pool(medium, group) if type(group) is int and group > 0 else medium


class VllmPrefixCache:
    def __init__(self) -> None:
        self.media: dict[str, dict[Any, CachedBlock]] = {}
        self.timeline: list[TimelinePoint] = []
        self.block_size: int | None = None
        self.batches = 0
        self.last_seq: int | None = None
        self.last_ts = 0.0
        self.unknown_removed = 0
        self.duplicates = 0
        self.unknown_types = 0
        self.clears = 0

    def clear(self) -> None:
        self.media = {m: {} for m in self.media}

    def apply(self, ts: float, events: list[dict[str, Any]], seq: int | None = None) -> None:
        """Apply one batch's events in order. Raises ``IndexFull`` (the index unchanged)
        when its stores would pass ``MAX_HASHES`` (module docstring)."""
        self._check_room(events, seq)
        stored = removed = 0
        cleared = False
        for ev in events:
            kind = ev.get(W.TAG)
            if kind == W.BLOCK_STORED:
                medium = self.media.setdefault(_medium(ev), {})
                hashes = ev["block_hashes"]
                bs = int(ev.get("block_size") or 0) or None
                self.block_size = bs or self.block_size
                per = len(ev.get("token_ids") or ()) // max(1, len(hashes))
                parent = ev.get("parent_block_hash")
                for h in hashes:
                    held = medium.get(h)
                    if held is not None:
                        self.duplicates += 1
                        held.copies += 1
                    else:
                        medium[h] = CachedBlock(parent, per or (bs or 0), ts)
                    parent = h
                stored += len(hashes)
            elif kind == W.BLOCK_REMOVED:
                medium = self.media.setdefault(_medium(ev), {})
                for h in ev["block_hashes"]:
                    held = medium.get(h)
                    if held is None:
                        self.unknown_removed += 1
                    elif held.copies > 1:
                        held.copies -= 1
                    else:
                        del medium[h]
                removed += len(ev["block_hashes"])
            elif kind == W.ALL_BLOCKS_CLEARED:
                self.clear()
                self.clears += 1
                cleared = True
            else:
                self.unknown_types += 1
        self.batches += 1
        self.last_seq, self.last_ts = seq, ts
        self.timeline.append(TimelinePoint(ts, stored, removed, cleared,
                                           {m: len(d) for m, d in self.media.items()}))

    def _check_room(self, events: list[dict[str, Any]], seq: int | None) -> None:
        held = sum(map(len, self.media.values()))
        count = held
        for ev in events:
            kind = ev.get(W.TAG)
            if kind == W.BLOCK_STORED:
                count += len(ev["block_hashes"])
                if count > MAX_HASHES:
                    raise IndexFull(
                        f"batch {seq} refused: its stores would take the prefix-cache "
                        f"index past {MAX_HASHES} hashes (it holds {held})")
            elif kind == W.ALL_BLOCKS_CLEARED:
                count = 0

    # ------------------------------------------------------------------ reading
    def hashes(self, medium: str = W.MEDIUM_GPU) -> set[Any]:
        return set(self.media.get(medium, {}))

    def prefix_depths(self, medium: str = W.MEDIUM_GPU) -> dict[Any, int]:
        """Hit-able prefix length in blocks per held hash: how many blocks from a root
        (parent None) down to it are all held; 0 when its chain is broken (an ancestor was
        removed, so a request cannot hit it: prefix hits need the whole chain)."""
        blocks = self.media.get(medium, {})
        depth: dict[Any, int] = {}
        for h in blocks:
            path, cur = [], h
            while cur is not None and cur in blocks and cur not in depth:
                path.append(cur)
                cur = blocks[cur].parent
            if cur is None:  # reached a first block: the chain is whole
                d, ok = 0, True
            elif cur in depth:
                d = depth[cur]
                ok = d > 0
            else:  # an ancestor is not held
                d, ok = 0, False
            for node in reversed(path):
                d = d + 1 if ok else 0
                depth[node] = d
        return depth

    def summary(self, medium: str = W.MEDIUM_GPU, now: float | None = None) -> dict[str, Any]:
        blocks = self.media.get(medium, {})
        depths = self.prefix_depths(medium)
        now = self.last_ts if now is None else now
        ages = sorted(now - b.stored_ts for b in blocks.values())
        leaves = {h for h in blocks} - {b.parent for b in blocks.values()}
        hitable = [depths[h] for h in leaves if depths.get(h, 0) > 0]
        return {
            "medium": medium, "blocks": len(blocks), "block_size": self.block_size,
            "prefixes": len(hitable), "longest_prefix_blocks": max(hitable, default=0),
            "orphans": sum(1 for d in depths.values() if d == 0),
            "age_median_s": ages[len(ages) // 2] if ages else 0.0,
            "age_max_s": ages[-1] if ages else 0.0,
        }
