"""Triton attention over a mixed-precision arena (per-key format read in the kernel)
against dequantize-then-attend, for every mix of page formats; under the interpreter on
CPU with tiny shapes."""

from __future__ import annotations

import itertools

import pytest
import torch

import kernels
from kernels import mixed_pages as mp
from kernels import reference
from tests.mixed.arena import filled_arena

BS, HKV, HQ, D = 4, 2, 4, 16
MIXES = [m for r in (1, 2, 3) for m in itertools.combinations(("full", "int8", "int4"), r)]


@pytest.mark.parametrize("mix", MIXES, ids=["+".join(m) for m in MIXES])
def test_mixed_attention_in_the_kernel_equals_dequantize_then_attend(mix, device):
    formats = [mix[i % len(mix)] for i in range(7)]
    fa = filled_arena(formats, torch.float32, BS, HKV, D, seed=len(mix) + 10)
    tables = torch.tensor([[5, 0, 6, 2], [3, 1, 4, 0]], dtype=torch.int32)
    lens = torch.tensor([13, 10], dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    codes = fa.code_tables(tables).to(device)
    args = [a.to(device) for a in (fa.k, fa.v, fa.ks, fa.vs)]
    for q_lens in ([5, 3], [1, 1]):  # prefill kernel, split-K decode
        cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
        q = torch.randn(int(cu[-1]), HQ, D, generator=gen)
        want = reference.paged_attention(q, fa.k_want, fa.v_want, tables, lens, cu, 0.25)
        with kernels.force_backend("triton"):
            got = mp.paged_attention(q.to(device), fa.layout, *args, codes, lens.to(device),
                                     cu.to(device), 0.25)
        torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)
