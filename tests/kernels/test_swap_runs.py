"""kvscope.kernels.swap_runs (the GPU <-> pinned-host fast path of swap_blocks) equals
reference.swap_blocks, its meaning. Its copies are device-agnostic torch, so they run here
on host tensors with the same spans the dispatcher computes; on a GPU the same code moves
the pages (the device check's `swap` section times it)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.kernels import reference, swap_runs

PAGE = (4, 2, 8)  # block_size, kv heads, head_dim


def test_runs_are_maximal_and_in_mapping_order():
    idx = torch.tensor([5, 6, 7, 2, 3, 9, 4, 5])
    assert swap_runs.runs(idx) == [(0, 5, 3), (3, 2, 2), (5, 9, 1), (6, 4, 2)]
    assert swap_runs.runs(torch.tensor([], dtype=torch.long)) == []
    assert swap_runs.worth_it([(0, 0, 8)], 8)
    assert not swap_runs.worth_it([(i, 2 * i, 1) for i in range(8)], 8)


@st.composite
def swaps(draw):
    n_src = draw(st.integers(1, 24))
    n_dst = draw(st.integers(1, 24))
    n = draw(st.integers(1, min(n_src, n_dst)))
    src = draw(st.permutations(range(n_src)))[:n]
    if draw(st.booleans()):  # host ids in runs, as the host tier hands them out
        start = draw(st.integers(0, n_dst - n))
        dst = list(range(start, start + n))
    else:
        dst = draw(st.permutations(range(n_dst)))[:n]
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int8,
                                  torch.float8_e4m3fn]))
    return n_src, n_dst, torch.tensor([src, dst]).T.contiguous(), dtype


def _pool(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((n, *PAGE), generator=g)
    return (x * 20).to(torch.int8) if dtype == torch.int8 else x.to(dtype)


@settings(max_examples=60, deadline=None)
@given(swaps())
def test_the_run_path_equals_the_reference(case):
    n_src, n_dst, mapping, dtype = case
    src, dst = _pool(n_src, dtype, 1), _pool(n_dst, dtype, 2)
    want = dst.clone()
    reference.swap_blocks(src, want, mapping)
    raw = reference.raw
    # out: gather on the "device", one copy per run of host pages
    got = dst.clone()
    swap_runs.to_host(raw(src), raw(got), mapping[:, 0], swap_runs.runs(mapping[:, 1]))
    assert torch.equal(raw(got), raw(want))
    # in: one copy per run of host pages, then one scatter on the "device"
    got = dst.clone()
    swap_runs.to_device(raw(src), raw(got), mapping[:, 1], swap_runs.runs(mapping[:, 0]))
    assert torch.equal(raw(got), raw(want))
