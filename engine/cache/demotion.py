"""When and which blocks to demote (bf16/fp32 -> int8 -> int4, or to the block-quantized
kivi4 / k8v4 / kivi2 pages), torch-free.

``plan_demotion`` runs between engine steps. When the gpu pool's *free frames* (not
counting cached blocks that could be evicted: demoting those is what keeps them) fall
under ``low`` x frames, or under the frames the first waiting request's next chunk needs
(the engine passes it as ``reserve``), it demotes the coldest full blocks until ``high`` x
frames (at least ``reserve``) are free, in at most two batches, one ``quantize`` event
each:

1. full-precision blocks -> ``formats[0]``;
2. if still short and two formats are enabled: ``formats[0]`` blocks -> ``formats[1]``,
   whole frames at a time (a frame is only freed when its last page leaves).

Coldness: a cached free block (ref 0) has no user and is coldest (in the eviction
policy's order); a block in use is as hot as its hottest user, measured in tokens from
the end of the block to the end of that sequence. Blocks within a sequence's last
``hot_window`` tokens, and partial blocks (still being written), are never demoted. So
with free frames above the watermark nothing is demoted at all: greedy outputs are those
of a full-precision pool. Only full blocks are demoted, which is also the residual-window
rule of the block-quantized formats (per-channel key scales over all of a block's tokens):
a block still being written stays in its full-precision page.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvscope.engine.cache.errors import CacheError
from kvscope.engine.cache.mixed_pool import BLOCK_FORMATS, DEMOTION_BITS

if TYPE_CHECKING:
    from kvscope.engine.cache.view import CacheView

# Shares of the frames: demote when fewer are free than LOW, up to HIGH. HIGH leaves room
# for a step's allocations (up to max_num_batched_tokens / block_size blocks) to come from
# free frames rather than from evicting cached prefixes.
LOW_WATERMARK = 0.10
HIGH_WATERMARK = 0.15


@dataclass(frozen=True)
class DemotionPolicy:
    """``formats``: the demotion chain (one or two of ``DEMOTION_BITS``, to strictly fewer
    bits, at most one block-quantized format: ``check_chain``); ``subs``:
    pages per frame of each (kernels.mixed_pages.MixedLayout.subs); ``hot_window`` in
    tokens."""

    formats: tuple[str, ...]
    subs: dict[str, int]
    hot_window: int = 256
    low: float = LOW_WATERMARK
    high: float = HIGH_WATERMARK

    def __post_init__(self) -> None:
        problem = check_chain(self.formats)
        if problem:
            raise CacheError(problem)
        if set(self.subs) != set(self.formats) or min(self.subs.values()) < 1:
            raise CacheError(f"subs {self.subs} must give pages per frame for {self.formats}")
        if not isinstance(self.hot_window, int) or self.hot_window < 0:
            raise CacheError(f"kv hot window must be an int >= 0 tokens, got {self.hot_window!r}")
        if not 0.0 <= self.low <= self.high < 1.0:
            raise CacheError(f"demotion watermarks must satisfy 0 <= low <= high < 1, got "
                             f"{self.low}, {self.high}")


def check_chain(formats: tuple[str, ...]) -> str | None:
    """Why ``formats`` is not a demotion chain (None when it is): one or two known targets,
    the second with strictly fewer bits than the first, at most one block-quantized."""
    names = ",".join(formats) or "none"
    if not formats or len(formats) > 2 or any(f not in DEMOTION_BITS for f in formats):
        return (f"kv demotion formats must be one or two of {', '.join(DEMOTION_BITS)} "
                f"(e.g. int8,int4 or int8,kivi4), got {names}")
    if len(formats) == 2 and DEMOTION_BITS[formats[1]] >= DEMOTION_BITS[formats[0]]:
        return f"kv demotion goes to fewer bits: int8,int4, not {names}"
    if sum(f in BLOCK_FORMATS for f in formats) > 1:
        return f"kv demotion takes at most one of {', '.join(BLOCK_FORMATS)}, got {names}"
    return None


def parse_formats(text: str) -> tuple[str, ...]:
    """'int8' | 'int4' | 'int8,int4' | 'kivi4' | 'int8,kivi2' ... -> a tuple; '' or 'off'
    -> ()."""
    text = (text or "").strip()
    if text in ("", "off", "none"):
        return ()
    return tuple(f.strip() for f in text.split(","))


def plan_demotion(m: CacheView, reserve: int = 0) -> list[tuple[int, int]]:
    """Demote cold blocks of ``m``'s gpu pool if it is under the watermark, or has fewer
    free frames than ``reserve`` (what the next admission needs); returns the (old, new)
    page codes of every demoted block, in batch order."""
    policy, pool = m.demotion, m.gpu
    low = max(math.ceil(policy.low * pool.num_frames), 1, reserve)
    high = max(math.ceil(policy.high * pool.num_frames), reserve)
    if len(pool.free_frames) >= low or high == 0:
        return []
    coldness = _coldness(m, policy.hot_window)
    orders: list[tuple[int, int]] = []
    first = policy.formats[0]
    full = [b for b in coldness if pool.fmt[b] == pool.kv_format]
    need = high - len(pool.free_frames)
    n = _count_for_gain(need, len(full), _open_subs(pool, first), pool.subs[first])
    if n:
        orders += pool.demote(full[:n], first)
    if len(policy.formats) == 2 and len(pool.free_frames) < high:
        blocks = _whole_frames(pool, [b for b in coldness if pool.fmt[b] == first], first,
                               policy.formats[1], high - len(pool.free_frames))
        if blocks:
            orders += pool.demote(blocks, policy.formats[1])
    return orders


def merge_orders(orders: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(source, destination) page codes for ONE batched gather-then-scatter of the
    (old, new) moves ``orders``, in order: a block moved twice (int8, then int4) is one
    order from its first page straight to its last (better codes, and no order reads a
    page another order of the batch writes first)."""
    origin: dict[int, int] = {}  # destination -> where its data is now
    for old, new in orders:
        origin[new] = origin.pop(old, old)
    return [(src, dst) for dst, src in origin.items()]


def _coldness(m: CacheView, hot_window: int) -> dict[int, float]:
    """Demotable blocks (holding a page, full, outside every user's hot window), coldest
    first: cached free blocks in eviction order (distance inf), then blocks in use by the
    distance of their hottest user, farthest first."""
    pool, bs = m.gpu, m.block_size
    distance: dict[int, int] = {}
    for seq in m.sequences.values():
        if seq.tier != "gpu" or not seq.block_table:
            continue
        n = seq.num_tokens
        table = seq.block_table
        for i in range(n // bs):
            d = n - (i + 1) * bs
            b = table[i]
            if d < distance.get(b, 1 << 62):
                distance[b] = d
    order: dict[int, float] = {b: math.inf for b in pool.evictable}
    used = sorted((b for b, d in distance.items() if d >= hot_window),
                  key=lambda b: (-distance[b], b))
    for b in used:
        order[b] = distance[b]
    return order


def _open_subs(pool, fmt: str) -> int:
    return sum(len(pool.free_subs[f]) for f in pool.open_frames[fmt])


def _count_for_gain(need: int, available: int, open_subs: int, k: int) -> int:
    """Fewest full-precision blocks to demote into k-per-frame pages for ``need`` frames
    (each frees its frame; pages beyond the open sub-slots take ceil(.../k) frames)."""
    for n in range(1, available + 1):
        if n - math.ceil(max(0, n - open_subs) / k) >= need:
            return n
    return available if available > 1 or open_subs else 0


def _whole_frames(pool, candidates: list[int], src_fmt: str, dst_fmt: str,
                  need: int) -> list[int]:
    """Blocks of whole ``src_fmt`` frames all of whose pages are candidates, coldest
    frame first, until moving them to ``dst_fmt`` frees ``need`` frames."""
    rank = {b: i for i, b in enumerate(candidates)}
    frames: dict[int, list[int]] = {}
    for b in candidates:
        frames.setdefault(pool.frame_of[b], []).append(b)
    whole = [(max(rank[b] for b in blocks), f, blocks) for f, blocks in frames.items()
             if len(blocks) == pool.residents[f]]
    whole.sort()
    open_subs, k = _open_subs(pool, dst_fmt), pool.subs[dst_fmt]
    chosen: list[int] = []
    freed = 0
    for _, _, blocks in whole:
        chosen += blocks
        freed += 1
        if freed - math.ceil(max(0, len(chosen) - open_subs) / k) >= need:
            break
    if freed - math.ceil(max(0, len(chosen) - open_subs) / k) <= 0:
        return []
    return chosen
