"""Swapping pages between a GPU and pinned host memory by runs: the fast path of
``swap_blocks`` (``reference.swap_blocks`` is its meaning; tests/kernels/test_swap_runs.py
proves them equal on random mappings).

Why: the reference's swap runs far below a pinned copy's bandwidth (docs/GPU.md). Out, it
gathers on the GPU and copies into PAGEABLE memory, then scatters with a single-threaded
host ``index_copy_``; in, it gathers on the host into a freshly pinned buffer. The host
side is pinned already (the Swapper's tier tensors), and the cache manager hands out host
blocks mostly in runs of consecutive ids, so each run of host pages is one slice: one DMA
each way into or out of it, with the gather or scatter done on the GPU, where it is cheap.

``runs(idx)``: the maximal runs of consecutive indices in mapping order. The run path is
taken only when the runs are few (on average at least ``MIN_RUN`` pages each); a scattered
mapping goes through the reference's staged copy.
"""

from __future__ import annotations

import torch

MIN_RUN = 2  # pages per run, on average, for the run path to beat one staged copy


def runs(idx: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(position in idx, first index, length)`` of each maximal run of consecutive values,
    in order: ``idx[pos:pos + n] == first + arange(n)``. Vectorised: ``swap_blocks`` asks
    once per cache tensor (K and V of every layer) for the same mapping."""
    n = int(idx.numel())
    if n == 0:
        return []
    starts = torch.cat([torch.zeros(1, dtype=torch.long),
                        torch.nonzero(idx[1:] - idx[:-1] != 1).flatten() + 1])
    lengths = torch.diff(starts, append=torch.tensor([n]))
    return list(zip(starts.tolist(), idx[starts].tolist(), lengths.tolist(), strict=True))


def worth_it(spans: list[tuple[int, int, int]], n: int) -> bool:
    return len(spans) * MIN_RUN <= n


def to_host(src: torch.Tensor, dst: torch.Tensor, src_idx: torch.Tensor,
            spans: list[tuple[int, int, int]]) -> None:
    """``dst[spans] <- src[src_idx]``: gather on ``src``'s device, then one copy per run of
    host pages (``spans`` over the destination indices). Copies into pinned memory return
    when their data has landed, as the reference's do."""
    gathered = src.index_select(0, src_idx.to(src.device))
    for pos, first, n in spans:
        dst[first:first + n].copy_(gathered[pos:pos + n])


def to_device(src: torch.Tensor, dst: torch.Tensor, dst_idx: torch.Tensor,
              spans: list[tuple[int, int, int]]) -> None:
    """``dst[dst_idx] <- src[spans]``: one copy per run of host pages (``spans`` over the
    source indices) into a staging tensor on ``dst``'s device, asynchronous from pinned
    memory, then one scatter there (ordered after the copies on the current stream)."""
    staged = torch.empty((int(dst_idx.numel()), *src.shape[1:]), dtype=src.dtype,
                         device=dst.device)
    non_blocking = src.is_pinned()
    for pos, first, n in spans:
        staged[pos:pos + n].copy_(src[first:first + n], non_blocking=non_blocking)
    dst.index_copy_(0, dst_idx.to(dst.device), staged)
