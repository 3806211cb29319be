"""Triton attention over a mixed-precision arena (per-key format read in the kernel)
against dequantize-then-attend, for every mix of page formats; under the interpreter on
CPU with tiny shapes."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvscope import kernels
from kvscope.kernels import mixed_pages as mp
from kvscope.kernels import reference
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_demotion_kernel_writes_the_torch_codes(dtype, device):
    """Full and int8 pages demoted in one batch, some into the frames the batch empties:
    the Triton scatter writes exactly the torch path's bytes (codes and scales)."""
    fa = filled_arena(["full", "int8", "full", "full", "int8", "full"], dtype, BS, HKV, D,
                      seed=21)
    lay = fa.layout
    src = torch.tensor([fa.codes[i] for i in (0, 1, 2, 3, 4)])
    dst = torch.tensor([lay.code(0, 0, "int4"), lay.code(0, 1, "int4"),
                        lay.code(2, 0, "int8"), lay.code(2, 1, "int8"),
                        lay.code(12, lay.subs("int4") - 1, "int4")])
    want_k, want_s = fa.k.clone(), fa.ks.clone()
    mp.demote(lay, want_k, want_s, src, dst)
    got_k, got_s = fa.k.clone().to(device), fa.ks.clone().to(device)
    with kernels.force_backend("triton"):
        mp.demote(lay, got_k, got_s, src.to(device), dst.to(device))
    touched = [0, 2, 12]
    if device == "cpu":
        assert torch.equal(got_k[touched], want_k[touched])
        assert torch.equal(got_s[touched], want_s[touched])
    for code in dst.tolist():
        c = torch.tensor([code])
        torch.testing.assert_close(
            mp.read_pages(lay, got_k.cpu(), got_s.cpu(), c, torch.float32),
            mp.read_pages(lay, want_k, want_s, c, torch.float32), atol=0.6, rtol=0.07)
