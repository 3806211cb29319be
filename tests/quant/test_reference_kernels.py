"""The torch reference kernels on quantized pages: attention reads exactly what the codes
mean, scales are written with their token and travel with their block."""

from __future__ import annotations

import pytest
import torch

from kvscope import kernels
from kvscope.kernels import reference
from tests.quant.pages import FORMATS, QuantPages, empty_pages, filled_pages

NB, BS, HKV, HQ, D = 10, 4, 2, 6, 16


def _batch(seq_lens, q_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NB, generator=gen)
    pages = [(n + BS - 1) // BS for n in seq_lens]
    tables = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    used = 0
    for b, p in enumerate(pages):
        tables[b, :p] = perm[used:used + p].int()
        used += p
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(cu[-1]), HQ, D, generator=gen)
    return q, tables, torch.tensor(seq_lens, dtype=torch.int32), cu


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [([13, 9], [13, 4]), ([13, 9, 5], [1, 1, 1]),
                                   ([13, 9], [1, 5])], ids=["prefill", "decode", "mixed"])
def test_attention_on_quantized_pages_equals_attention_on_dequantized_pages(fmt, shape):
    pages = filled_pages(fmt, NB, BS, HKV, D)
    q, tables, lens, cu = _batch(*shape)
    got = kernels.paged_attention(q, pages.k_cache, pages.v_cache, tables, lens, cu, 0.25,
                                  **pages.scales)
    k_deq, v_deq = pages.dequantized()
    want = reference.paged_attention(q, k_deq, v_deq, tables, lens, cu, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_reshape_and_cache_writes_codes_and_scales_only_at_real_slots(fmt):
    pages = empty_pages(fmt, NB, BS, HKV, D)
    before = [t.clone() for t in (pages.k_cache, pages.v_cache)]
    gen = torch.Generator().manual_seed(3)
    key, value = torch.randn(5, HKV, D, generator=gen), torch.randn(5, HKV, D, generator=gen)
    slots = torch.tensor([7, -1, 12, -1, 30])
    kernels.reshape_and_cache(key, value, pages.k_cache, pages.v_cache, slots, **pages.scales)
    k_deq, v_deq = pages.dequantized()
    written = torch.zeros(NB * BS, dtype=torch.bool)
    written[[7, 12, 30]] = True
    for new, old in zip((pages.k_cache, pages.v_cache), before, strict=True):
        changed = (new.view(torch.uint8) != old.view(torch.uint8)).flatten(0, 1)
        assert not bool(changed.flatten(1)[~written].any())
    tol = {"fp8": 0.2, "int8": 0.03, "int4": 0.5}[fmt]
    for deq, x in ((k_deq, key), (v_deq, value)):
        flat = deq.flatten(0, 1)
        torch.testing.assert_close(flat[[7, 12, 30]], x[[0, 2, 4]], atol=tol, rtol=0.07)
    if fmt != "fp8":  # per-token scales: written at exactly the same slots
        assert bool((pages.k_scale.flatten(0, 1)[written, :, 0] > 0).all())
        assert bool((pages.k_scale.flatten(0, 1)[~written] == 0).all())


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_copy_on_write_copies_scales_with_the_page(fmt):
    layers = [filled_pages(fmt, NB, BS, HKV, D, seed=s) for s in range(2)]
    mapping = torch.tensor([[1, 8], [3, 9]])
    kernels.copy_blocks([p.k_cache for p in layers], [p.v_cache for p in layers], mapping,
                        k_scales=[p.k_scale for p in layers],
                        v_scales=[p.v_scale for p in layers])
    for p in layers:
        k_deq, v_deq = p.dequantized()
        for src, dst in mapping.tolist():
            for t in (p.k_cache, p.v_cache, p.k_scale, p.v_scale):
                assert torch.equal(t[dst], t[src])
            assert torch.equal(k_deq[dst], k_deq[src]) and torch.equal(v_deq[dst], v_deq[src])


@pytest.mark.parametrize("fmt", FORMATS)
def test_copy_blocks_without_the_scales_it_needs_is_rejected_before_any_copy(fmt):
    p = filled_pages(fmt, NB, BS, HKV, D)
    before = p.k_cache.clone()
    mapping = torch.tensor([[1, 8]])
    if fmt == "fp8":  # per-layer scales do not travel with blocks: passing them is a bug
        with pytest.raises(ValueError, match="no per-token scales"):
            kernels.copy_blocks([p.k_cache], [p.v_cache], mapping, k_scales=[p.k_scale],
                                v_scales=[p.v_scale])
        kernels.copy_blocks([p.k_cache], [p.v_cache], mapping)  # fp8 bytes copy fine
        assert torch.equal(p.k_cache[8].view(torch.uint8), p.k_cache[1].view(torch.uint8))
        return
    with pytest.raises(ValueError, match="need k_scales and v_scales"):
        kernels.copy_blocks([p.k_cache], [p.v_cache], mapping)
    assert torch.equal(p.k_cache.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
def test_swap_moves_scales_with_their_blocks(fmt):
    src = filled_pages(fmt, NB, BS, HKV, D)
    dst = empty_pages(fmt, 4, BS, HKV, D)
    mapping = torch.tensor([[2, 0], [7, 3]])
    pairs = [(src.k_cache, dst.k_cache), (src.v_cache, dst.v_cache)]
    if fmt != "fp8":
        pairs += [(src.k_scale, dst.k_scale), (src.v_scale, dst.v_scale)]
    for s, d in pairs:
        kernels.swap_blocks(s, d, mapping)
    k_src, v_src = src.dequantized()
    if fmt == "fp8":  # the per-layer scales stay with the layer, not the block
        dst = QuantPages(fmt, dst.k_cache, dst.v_cache, src.k_scale, src.v_scale)
    dst_k, dst_v = dst.dequantized()
    for s, d in mapping.tolist():
        assert torch.equal(dst_k[d], k_src[s]) and torch.equal(dst_v[d], v_src[s])


def test_bad_scales_are_clear_errors_and_change_nothing():
    p = empty_pages("int8", NB, BS, HKV, D)
    key = torch.randn(2, HKV, D)
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="need k_scale"):
        kernels.reshape_and_cache(key, key, p.k_cache, p.v_cache, slots)
    with pytest.raises(ValueError, match="k_scale must be"):
        kernels.reshape_and_cache(key, key, p.k_cache, p.v_cache, slots,
                                  k_scale=p.k_scale.float(), v_scale=p.v_scale)
    assert not p.k_cache.any() and not p.k_scale.any()
    auto = torch.zeros(NB, BS, HKV, D)
    with pytest.raises(ValueError, match="unquantized"):
        kernels.reshape_and_cache(key, key, auto, auto.clone(), slots,
                                  k_scale=torch.ones(HKV))
    fp8 = empty_pages("fp8", NB, BS, HKV, D)
    with pytest.raises(ValueError, match="fp8 pages must be fp32"):
        kernels.reshape_and_cache(key, key, fp8.k_cache, fp8.v_cache, slots,
                                  k_scale=torch.ones(HKV + 1))
    with pytest.raises(ValueError, match="not a page format"):
        kernels.reshape_and_cache(key, key, auto.to(torch.int16), auto.to(torch.int16), slots)
