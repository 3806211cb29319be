"""Triton kernels on quantized pages (fp8, int8, int4) against the torch reference, under
the interpreter on CPU (tiny shapes: every program costs ~0.5 ms there)."""

from __future__ import annotations

import pytest
import torch

from kvscope import kernels
from kvscope.kernels import quant, reference
from tests.quant.pages import FORMATS, empty_pages, filled_pages

NB, BS, HKV, HQ, D = 8, 4, 2, 4, 16


@pytest.mark.parametrize("fmt", FORMATS)
def test_reshape_and_cache_writes_the_reference_codes_and_scales(fmt, device):
    gen = torch.Generator().manual_seed(1)
    t = 9
    key = torch.randn(t, HKV, D, generator=gen) * 4.0
    key[0, 0] = torch.linspace(-30, 30, D)  # fp8 ties and binade carries (7.8 -> 8.0)
    value = torch.randn(t, HKV, D, generator=gen)
    slots = torch.randperm(NB * BS, generator=gen)[:t]
    slots[[2, 5]] = -1
    want = empty_pages(fmt, NB, BS, HKV, D)
    got = empty_pages(fmt, NB, BS, HKV, D).to(device)
    reference.reshape_and_cache(key, value, want.k_cache, want.v_cache, slots, **want.scales)
    with kernels.force_backend("triton"):
        kernels.reshape_and_cache(key.to(device), value.to(device), got.k_cache, got.v_cache,
                                  slots.to(device), **got.scales)
    got = got.to("cpu")
    if device == "cpu":  # same arithmetic, same codes, bit for bit
        for g, w in ((got.k_cache, want.k_cache), (got.v_cache, want.v_cache)):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
        if fmt != "fp8":
            assert torch.equal(got.k_scale, want.k_scale)
            assert torch.equal(got.v_scale, want.v_scale)
    else:  # a GPU division may differ in the last bit: at most one code step apart
        for g, w in zip(got.dequantized(), want.dequantized(), strict=True):
            torch.testing.assert_close(g, w, atol=0.6, rtol=0.07)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [([13, 6], [13, 3]), ([13, 6], [1, 1])],
                         ids=["prefill", "decode"])
def test_attention_dequantizes_in_the_kernel(fmt, shape, device):
    seq_lens, q_lens = shape
    pages = filled_pages(fmt, NB, BS, HKV, D, seed=2)
    gen = torch.Generator().manual_seed(3)
    tables = torch.tensor([[5, 0, 7, 2], [3, 6, 0, 0]], dtype=torch.int32)
    cu = torch.tensor([0, q_lens[0], q_lens[0] + q_lens[1]], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(int(cu[-1]), HQ, D, generator=gen)
    k_deq, v_deq = pages.dequantized()
    want = reference.paged_attention(q, k_deq, v_deq, tables, lens, cu, 0.25)
    dev = pages.to(device)
    with kernels.force_backend("triton"):
        got = kernels.paged_attention(q.to(device), dev.k_cache, dev.v_cache,
                                      tables.to(device), lens.to(device), cu.to(device), 0.25,
                                      **dev.scales)
    torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_copy_blocks_copies_pages_and_scales(fmt, device):
    pages = filled_pages(fmt, NB, BS, HKV, D, seed=4).to(device)
    mapping = torch.tensor([[1, 6], [4, 7]], device=device)
    per_token = quant.scale_params(fmt) > 0
    with kernels.force_backend("triton"):
        kernels.copy_blocks([pages.k_cache], [pages.v_cache], mapping,
                            k_scales=[pages.k_scale] if per_token else None,
                            v_scales=[pages.v_scale] if per_token else None)
    tensors = [pages.k_cache, pages.v_cache] + ([pages.k_scale, pages.v_scale] if per_token
                                                else [])
    for t in tensors:
        raw = t.view(torch.uint8) if t.dtype == quant.FP8_DTYPE else t
        assert torch.equal(raw[6], raw[1]) and torch.equal(raw[7], raw[4])
