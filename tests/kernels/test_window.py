"""Sliding-window paged attention: the reference kernel and the CPU step plan against the
contiguous oracle, sequence by sequence, for decodes, a prefill after cached context and a
fresh prefill; a window wider than every sequence is plain causal attention."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels import cpu_native, reference
from kvscope.kernels.contiguous import contiguous_attention
from kvscope.kernels.cpu_attention import StepPlan
from tests.kernels.test_cpu_attention import BS, HAS_CC, HKV, HQ, NB, D, _caches, _step, decode_path

__all__ = ["decode_path"]  # the fixture, imported for the tests here

SCALE = D ** -0.5


def _filled_step(fmt: str = "auto"):
    slots, tables, lens, cu = _step(padding=False)
    g = torch.Generator().manual_seed(3)
    num_tokens = int(cu[-1])
    q, k, v = (torch.randn(num_tokens, h, D, generator=g) for h in (HQ, HKV, HKV))
    caches = _caches(fmt)
    for c in caches[:2]:
        if fmt == "auto":
            c.copy_(torch.randn(c.shape, generator=g))
        else:
            c.copy_(torch.randint(-100, 100, c.shape, generator=g).to(c.dtype))
    return slots, tables, lens, cu, q, k, v, caches


def _oracle(q, kc, vc, tables, lens, cu, window):
    """Each sequence's keys gathered into one tensor, then contiguous attention."""
    out = torch.empty_like(q)
    for b in range(lens.numel()):
        start, end, n = int(cu[b]), int(cu[b + 1]), int(lens[b])
        pages = tables[b, :(n + BS - 1) // BS].long()
        keys = kc[pages].flatten(0, 1)[:n]
        values = vc[pages].flatten(0, 1)[:n]
        out[start:end] = contiguous_attention(q[start:end], keys, values, n - (end - start),
                                              SCALE, window=window)
    return out


@pytest.mark.parametrize("window", [1, 3, 5])
def test_reference_window_matches_the_contiguous_oracle(window):
    slots, tables, lens, cu, q, k, v, (kc, vc, _, _) = _filled_step()
    reference.reshape_and_cache(k, v, kc, vc, slots)
    got = reference.paged_attention(q, kc, vc, tables, lens, cu, SCALE, window=window)
    torch.testing.assert_close(got, _oracle(q, kc, vc, tables, lens, cu, window), rtol=1e-5,
                               atol=1e-5)
    full = reference.paged_attention(q, kc, vc, tables, lens, cu, SCALE)
    assert not torch.allclose(got, full)  # the window really hides keys


def test_a_window_wider_than_every_sequence_is_causal_attention():
    slots, tables, lens, cu, q, k, v, (kc, vc, _, _) = _filled_step()
    reference.reshape_and_cache(k, v, kc, vc, slots)
    wide = reference.paged_attention(q, kc, vc, tables, lens, cu, SCALE,
                                     window=int(lens.max()))
    torch.testing.assert_close(wide, reference.paged_attention(q, kc, vc, tables, lens, cu,
                                                               SCALE), rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["auto", "int8"])
@pytest.mark.parametrize("window", [2, 5])
def test_step_plan_window_matches_the_reference(fmt, window, decode_path):
    """Its decodes through the native kernel with the window (auto pages), or the torch
    path's window pages and masks (int8 pages, or decode_path torch)."""
    slots, tables, lens, cu, q, k, v, caches = _filled_step(fmt)
    ref = tuple(None if c is None else c.clone() for c in caches)
    kc, vc, ks, vs = ref
    reference.reshape_and_cache(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
    want = reference.paged_attention(q, kc, vc, tables, lens, cu, SCALE, k_scale=ks,
                                     v_scale=vs, window=window)
    plan = StepPlan(slots, tables, lens, cu, BS, NB)
    pkc, pvc, pks, pvs = caches
    # a full layer then a windowed one in the same step, as in a hybrid model
    plan.forward(q, k, v, pkc.clone(), pvc.clone(), SCALE,
                 k_scale=None if pks is None else pks.clone(),
                 v_scale=None if pvs is None else pvs.clone())
    got = plan.forward(q, k, v, pkc, pvc, SCALE, k_scale=pks, v_scale=pvs, window=window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(pkc, kc) and torch.equal(pvc, vc)


@pytest.mark.parametrize("window", [2, 5, 8])
def test_windowed_decode_gathers_at_most_the_window_pages(window):
    """A windowed decode reads the pages from the one holding its first visible key: at most
    ceil(W / block_size) + 1 per sequence, however long the sequence."""
    slots, tables, lens, cu, *_ = _filled_step()
    decode = StepPlan(slots, tables, lens, cu, BS, NB)._window_decode(window)
    assert decode
    for pages, mask in decode:
        assert pages.numel() // mask.shape[0] <= -(-window // BS) + 1


@pytest.mark.parametrize("window", [1, 7, 8, 9, 20])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_decode_window_matches_the_reference(window, num_splits, device):
    """Block size 8 and key tiles of 16 (interpreter): windows inside one tile, on a page
    edge and across tiles; with 3 splits the early ones fall wholly before the window."""
    from tests.kernels.compare import assert_close, triton_attention
    from tests.kernels.oracle import make_batch

    batch = make_batch([1, 7, 9, 17, 40, 63], [1] * 6, 6, 2, 64, 8, seed=window)
    got = triton_attention(batch, device, 0.125, num_splits=num_splits, window=window)
    want = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                     batch.seq_lens, batch.cu_seqlens_q, 0.125, window=window)
    assert_close(got, want, torch.float32)


@pytest.mark.parametrize("window", [1, 5, 16, 33])
def test_triton_prefill_window_matches_the_reference(window, device):
    """Fresh prefills and prefills after cached context, mixed with a decode."""
    from tests.kernels.compare import assert_close, triton_attention
    from tests.kernels.oracle import make_batch

    batch = make_batch([20, 45, 9, 70], [20, 13, 1, 40], 4, 2, 64, 8, seed=window)
    got = triton_attention(batch, device, 0.125, window=window)
    want = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                     batch.seq_lens, batch.cu_seqlens_q, 0.125, window=window)
    assert_close(got, want, torch.float32)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,hkv,group", [(16, 2, 3), (64, 2, 4), (128, 1, 3)])
@pytest.mark.parametrize("bs", [6, 16])
@pytest.mark.parametrize("window", [1, 7, 300])
def test_native_decode_window_reads_only_the_window_pages(dtype, d, hkv, group, bs, window):
    """The native decode kernel with a window equals the reference with it: sequences
    shorter and longer than W, GQA, head sizes of the portable and the AVX-512 loops, and
    with two threads a long sequence cut into key chunks (split-K) inside its window. Every
    page wholly before a window is NaN: one read of it would poison the output."""
    g = torch.Generator().manual_seed(window + d + bs)
    hq, lens = hkv * group, torch.tensor([1, 5, 64, 300, 700])
    width = (700 + bs - 1) // bs
    nb = int(sum((n + bs - 1) // bs for n in lens.tolist())) + 1
    kc = (3 * torch.randn(nb, bs, hkv, d, generator=g)).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    tables = torch.full((lens.numel(), width), nb - 1)  # junk past each length: a NaN page
    used = 0
    for s, n in enumerate(lens.tolist()):
        own = (n + bs - 1) // bs
        tables[s, :own] = torch.arange(used, used + own)
        used += own
    q = torch.randn(lens.numel(), hq, d, generator=g).to(dtype)
    want = reference.paged_attention(q.float(), kc.float(), vc.float(), tables.int(),
                                     lens.int(), torch.arange(lens.numel() + 1, dtype=torch.int32),
                                     d ** -0.5, window=window)
    for s, n in enumerate(lens.tolist()):  # now poison what the window does not need
        first_page = max(n - window, 0) // bs
        kc[tables[s, :first_page]] = float("nan")
        vc[tables[s, :first_page]] = float("nan")
    kc[nb - 1] = vc[nb - 1] = float("nan")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = cpu_native.paged_decode(q, kc, vc, tables, lens, d ** -0.5, window=window)
        one = cpu_native.paged_decode(q[4:], kc, vc, tables[4:], lens[4:], d ** -0.5,
                                      window=window)  # alone: split-K over its window
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one, want[4:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 3, 9])
def test_windowed_pure_decode_step_writes_and_attends(window, decode_path):
    """A pure decode step of a windowed layer (the native path: one fused write-and-attend
    call with the window): pages and output equal the reference's."""
    num_decode = 11
    slots, tables, lens, cu = _step(num_decode=num_decode, padding=False)
    slots, tables, lens, cu = (slots[:num_decode], tables[:num_decode], lens[:num_decode],
                               cu[:num_decode + 1])
    g = torch.Generator().manual_seed(window)
    q, k, v = (torch.randn(num_decode, h, D, generator=g) for h in (HQ, HKV, HKV))
    kc, vc = torch.randn(NB, BS, HKV, D, generator=g), torch.randn(NB, BS, HKV, D, generator=g)
    rk, rv = kc.clone(), vc.clone()
    reference.reshape_and_cache(k, v, rk, rv, slots)
    want = reference.paged_attention(q, rk, rv, tables, lens, cu, SCALE, window=window)
    got = StepPlan(slots, tables, lens, cu, BS, NB).forward(q, k, v, kc, vc, SCALE,
                                                            window=window)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if window < int(lens.max()):
        full = reference.paged_attention(q, rk, rv, tables, lens, cu, SCALE)
        assert not torch.allclose(got, full)  # the window really hides keys
