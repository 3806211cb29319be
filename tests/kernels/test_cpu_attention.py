"""kernels.cpu_attention.StepPlan (the engine's CPU path) against kernels.reference: the same
cache writes and the same attention, for a mixed step (decode rows, a prefill with cached
context, a fresh prefill, a padding slot), float and quantized pages; bad steps are rejected
before anything is written. Decode runs both ways: through the native kernel
(kernels/cpu_native.py) and through torch ops."""

from __future__ import annotations

import shutil

import pytest
import torch

from kvscope.kernels import cpu_native, quant, reference
from kvscope.kernels.cpu_attention import DECODE_GROUP, StepPlan

BS, NB, HQ, HKV, D = 4, 64, 6, 2, 16
HAS_CC = bool(shutil.which("cc") or shutil.which("gcc"))


@pytest.fixture(params=["native", "torch"])
def decode_path(request, monkeypatch):
    """Run the test with the native decode kernel, then with the torch ops path."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_native, "supports", lambda k_cache, v_cache: False)
    elif not HAS_CC:
        pytest.skip("no C compiler on this machine: the native kernel cannot be built")
    else:
        assert cpu_native.paged_decode_kernel() is not None, "the native kernel did not build"
    return request.param


def _step(num_decode: int = DECODE_GROUP + 3, padding: bool = True):
    """Sequences: ``num_decode`` decoding (lengths 1..), one prefill of 5 tokens after 6
    cached, one fresh prefill of 3; a padding token (slot -1) at the end of the batch
    unless ``padding`` is False."""
    g = torch.Generator().manual_seed(0)
    seq_lens, q_lens = [], []
    for i in range(num_decode):
        seq_lens.append(1 + (i * 5) % 13)
        q_lens.append(1)
    seq_lens += [11, 3]
    q_lens += [5, 3]
    pages = torch.randperm(NB, generator=g)
    tables, slots, used = [], [], 0
    width = max((n + BS - 1) // BS for n in seq_lens)
    for n, q in zip(seq_lens, q_lens, strict=True):
        own = pages[used:used + (n + BS - 1) // BS]
        used += own.numel()
        tables.append(torch.cat([own, torch.full((width - own.numel(),), NB + 7)]))  # junk pad
        for pos in range(n - q, n):
            slots.append(int(own[pos // BS]) * BS + pos % BS)
    if padding:
        q_lens[-1] += 1  # the padding token rides with the last sequence's queries, as one
        seq_lens[-1] += 1  # more position whose key is never written (both read the same)
        slots.append(-1)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return (torch.tensor(slots), torch.stack(tables).to(torch.int32),
            torch.tensor(seq_lens, dtype=torch.int32), cu)


def _caches(fmt: str):
    dtype = quant.cache_dtype(fmt, torch.float32)
    width = quant.packed_dim(fmt, D)
    k = torch.zeros(NB, BS, HKV, width, dtype=dtype)
    scales = (None, None)
    if quant.scale_params(fmt):
        scales = tuple(torch.ones(NB, BS, HKV, quant.scale_params(fmt), dtype=quant.SCALE_DTYPE)
                       for _ in range(2))
    return k, k.clone(), *scales


@pytest.mark.parametrize("fmt,padding", [("auto", True), ("auto", False), ("int8", True),
                                         ("fp8", False)])
def test_plan_matches_the_reference(fmt, padding, decode_path):
    """With no padding slot the fresh prefill attends over the K/V it was given (auto
    pages): still the reference's result. fp8 pages are written as bytes."""
    slots, tables, lens, cu = _step(padding=padding)
    last = tables.shape[0] - 1
    need = (int(lens[last]) + BS - 1) // BS
    assert int(tables[last, need - 1]) < NB, "the padding position lands on an owned page"
    g = torch.Generator().manual_seed(1)
    num_tokens = int(cu[-1])
    q = torch.randn(num_tokens, HQ, D, generator=g)
    k = torch.randn(num_tokens, HKV, D, generator=g)
    v = torch.randn(num_tokens, HKV, D, generator=g)
    ref_caches, plan_caches = _caches(fmt), _caches(fmt)
    if fmt == "fp8":  # per-head scales
        ref_caches = (*ref_caches[:2], torch.full((HKV,), 0.05), torch.full((HKV,), 0.07))
        plan_caches = (*plan_caches[:2], *(s.clone() for s in ref_caches[2:]))
    # pre-fill the cached context identically in both (random history)
    for a, b in zip(ref_caches, plan_caches, strict=True):
        if a is not None and a.dtype == quant.FP8_DTYPE:
            a.copy_(torch.randn(a.shape, generator=g).to(a.dtype))
            b.view(torch.uint8).copy_(a.view(torch.uint8))
        elif a is not None and a.dtype.is_floating_point and a.dim() > 1:
            a.copy_(torch.randn(a.shape, generator=g).to(a.dtype))
            b.copy_(a)
        elif a is not None:
            a.copy_(torch.randint(-100, 100, a.shape, generator=g).to(a.dtype))
            b.copy_(a)
    kc, vc, ks, vs = ref_caches
    reference.reshape_and_cache(k, v, kc, vc, slots, k_scale=ks, v_scale=vs)
    want = reference.paged_attention(q, kc, vc, tables, lens, cu, D ** -0.5, k_scale=ks,
                                     v_scale=vs)
    pkc, pvc, pks, pvs = plan_caches
    plan = StepPlan(slots, tables, lens, cu, BS, NB)
    got = plan.forward(q, k, v, pkc, pvc, D ** -0.5, k_scale=pks, v_scale=pvs)
    for a, b in zip(ref_caches, plan_caches, strict=True):
        if a is not None:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)) \
                if a.dtype == quant.FP8_DTYPE else torch.equal(a, b)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_pages_compute_in_fp32_and_return_bf16(decode_path):
    slots, tables, lens, cu = _step(num_decode=3)
    g = torch.Generator().manual_seed(2)
    n = int(cu[-1])
    q, k, v = (torch.randn(n, h, D, generator=g).bfloat16() for h in (HQ, HKV, HKV))
    kc = torch.randn(NB, BS, HKV, D, generator=g).bfloat16()
    vc = kc.clone()
    rk, rv = kc.clone(), vc.clone()
    reference.reshape_and_cache(k, v, rk, rv, slots)
    want = reference.paged_attention(q.float(), rk.float(), rv.float(), tables, lens, cu,
                                     D ** -0.5)
    got = StepPlan(slots, tables, lens, cu, BS, NB).forward(q, k, v, kc, vc, D ** -0.5)
    assert got.dtype == torch.bfloat16
    assert torch.equal(kc, rk) and torch.equal(vc, rv)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_bad_steps_raise_before_writing():
    slots, tables, lens, cu = _step(num_decode=2)
    with pytest.raises(ValueError, match="slot_mapping out of range"):
        StepPlan(torch.where(slots >= 0, slots + NB * BS, slots), tables, lens, cu, BS, NB)
    with pytest.raises(ValueError, match="shorter than q_lens"):
        StepPlan(slots, tables, torch.ones_like(lens), cu, BS, NB)
    n = int(cu[-1])
    plan = StepPlan(slots, tables, lens, cu, BS, NB)
    kc = torch.zeros(NB, BS, HKV, D)
    vc = kc.clone()
    with pytest.raises(ValueError, match="key must be"):  # wrong head count: nothing written
        plan.forward(torch.zeros(n, HQ, D), torch.ones(n, HKV + 1, D), torch.ones(n, HKV + 1, D),
                     kc, vc, 1.0)
    assert not kc.any() and not vc.any()


def _shuffled_tables(lens: torch.Tensor, bs: int, nb: int, width: int,
                     g: torch.Generator) -> torch.Tensor:
    """Block tables [len(lens), width]: each sequence's pages drawn from a shuffle of the
    nb pages (no page shared), junk ids (>= nb) past each length."""
    tables = torch.full((lens.numel(), width), nb + 99)
    perm = torch.randperm(nb, generator=g)
    used = 0
    for i, n in enumerate(lens.tolist()):
        need = (n + bs - 1) // bs
        tables[i, :need] = perm[used:used + need]
        used += need
    return tables


@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_reads_pages_in_place(dtype):
    """Long, ragged decodes (GQA group 3, pages shuffled, a table wider than needed with
    junk past each length): the native kernel equals the reference, and float32/bfloat16
    pages take it."""
    g = torch.Generator().manual_seed(3)
    seqs, bs, nb = 5, 16, 200
    kc = torch.randn(nb, bs, HKV, D, generator=g).to(dtype)
    vc = torch.randn(nb, bs, HKV, D, generator=g).to(dtype)
    lens = torch.tensor([1, 17, 200, 333, 64])
    tables = _shuffled_tables(lens, bs, nb, 30, g)
    q = torch.randn(seqs, HQ, D, generator=g)
    assert cpu_native.supports(kc, vc)
    got = cpu_native.paged_decode(q, kc, vc, tables, lens, 0.3)
    want = reference.paged_attention(q, kc.float(), vc.float(), tables.int(), lens.int(),
                                     torch.arange(seqs + 1, dtype=torch.int32), 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_native_decode_declines_what_it_cannot_read():
    """Quantized, fp16 and strided pages take the torch path."""
    int8 = torch.zeros(4, BS, HKV, D, dtype=torch.int8)
    fp16 = torch.zeros(4, BS, HKV, D, dtype=torch.float16)
    strided = torch.zeros(4, BS, HKV, 2 * D)[..., :D]
    for pages in (int8, fp16, strided):
        assert not cpu_native.supports(pages, pages)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("lens", [[700], [1, 333], [129, 1000, 5]])
def test_native_decode_splits_few_sequences_by_key_range(dtype, threads, lens):
    """Fewer sequences than threads: long ones are cut into key chunks (split-K) whose
    partial softmaxes merge to the reference's answer; short ones stay whole."""
    g = torch.Generator().manual_seed(len(lens) * 10 + threads)
    bs, nb = 16, 200
    kc = (4 * torch.randn(nb, bs, HKV, D, generator=g)).to(dtype)  # peaked: chunk maxima differ
    vc = torch.randn(nb, bs, HKV, D, generator=g).to(dtype)
    n_seqs = len(lens)
    tables = torch.randperm(nb, generator=g)[:n_seqs * 64].view(n_seqs, 64)
    q = torch.randn(n_seqs, HQ, D, generator=g)
    lens_t = torch.tensor(lens)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_native.paged_decode(q, kc, vc, tables, lens_t, 0.2)
    finally:
        torch.set_num_threads(before)
    want = reference.paged_attention(q, kc.float(), vc.float(), tables.int(), lens_t.int(),
                                     torch.arange(n_seqs + 1, dtype=torch.int32), 0.2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_step_from_fused_qkv_views(dtype, decode_path):
    """A pure decode step as the model hands it over: q, k and v are strided views into one
    fused qkv row per token. The native path writes the K/V rows and attends in one call;
    pages and output equal the reference (computed in fp32, cast to the model dtype)."""
    num_decode = 5
    slots, tables, lens, cu = _step(num_decode=num_decode)
    keep = num_decode  # the decodes only: drop the two prefills and the padding token
    slots, tables, lens, cu = slots[:keep], tables[:keep], lens[:keep], cu[:keep + 1]
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(keep, (HQ + 2 * HKV) * D, generator=g).to(dtype)
    q = qkv[:, :HQ * D].view(keep, HQ, D)
    k = qkv[:, HQ * D:(HQ + HKV) * D].view(keep, HKV, D)
    v = qkv[:, (HQ + HKV) * D:].view(keep, HKV, D)
    kc = torch.randn(NB, BS, HKV, D, generator=g).to(dtype)
    vc = torch.randn(NB, BS, HKV, D, generator=g).to(dtype)
    rk, rv = kc.clone(), vc.clone()
    reference.reshape_and_cache(k, v, rk, rv, slots)
    want = reference.paged_attention(q.float(), rk.float(), rv.float(), tables, lens, cu,
                                     D ** -0.5).to(dtype)
    got = StepPlan(slots, tables, lens, cu, BS, NB).forward(q, k, v, kc, vc, D ** -0.5)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
def test_native_decode_of_no_sequences_is_empty():
    kc = torch.zeros(4, BS, HKV, D)
    got = cpu_native.paged_decode(torch.zeros(0, HQ, D), kc, kc.clone(),
                                  torch.zeros(0, 2, dtype=torch.int64),
                                  torch.zeros(0, dtype=torch.int64), 1.0)
    assert got.shape == (0, HQ, D)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
@pytest.mark.parametrize("threads", [1, 2])
def test_native_decode_bf16_query_at_model_head_size(threads):
    """SmolLM2's shapes (9 q / 3 kv heads of 64): a bfloat16 query over bfloat16 pages takes
    the bfloat16 dot-product instructions where the CPU has them; the result still equals
    the reference computed in float32 from the same bfloat16 values."""
    hq, hkv, d, bs, nb = 9, 3, 64, 16, 96
    g = torch.Generator().manual_seed(7)
    kc = (3 * torch.randn(nb, bs, hkv, d, generator=g)).bfloat16()
    vc = torch.randn(nb, bs, hkv, d, generator=g).bfloat16()
    lens = torch.tensor([300, 5, 511])
    tables = torch.randperm(nb, generator=g)[:3 * 32].view(3, 32)
    q = torch.randn(3, hq, d, generator=g).bfloat16()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_native.paged_decode(q, kc, vc, tables, lens, d ** -0.5)
        one = cpu_native.paged_decode(q[2:], kc, vc, tables[2:], lens[2:], d ** -0.5)  # split-K
    finally:
        torch.set_num_threads(before)
    want = reference.paged_attention(q.float(), kc.float(), vc.float(), tables.int(),
                                     lens.int(), torch.arange(4, dtype=torch.int32), d ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one, want[2:], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
@pytest.mark.parametrize("page_dtype,q_dtype", [(torch.float32, torch.float32),
                                                (torch.bfloat16, torch.bfloat16),
                                                (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("d,hkv,group", [(64, 3, 3), (64, 2, 4), (64, 1, 5), (128, 2, 4),
                                         (128, 1, 3), (128, 4, 1)])
@pytest.mark.parametrize("bs", [1, 6, 16])
def test_native_decode_at_model_head_sizes(page_dtype, q_dtype, d, hkv, group, bs):
    """The head sizes the engine's models use (64, 128) take the kernel's register-resident
    loops (kernels/cpu_decode_avx512.h where the CPU has AVX-512): every GQA group size
    (query heads split into register passes of 1-3), pages whose row count is not a multiple
    of four, one key, and sequences cut into key chunks that start mid-page (split-K, two
    threads). Each equals the float32 reference over the same page values."""
    g = torch.Generator().manual_seed(d + 10 * hkv + group + 1000 * bs)
    hq, nb = hkv * group, 600
    kc = (3 * torch.randn(nb, bs, hkv, d, generator=g)).to(page_dtype)  # peaked softmax
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(page_dtype)
    lens = torch.tensor([1, 7, 300, 45, 131])
    tables = _shuffled_tables(lens, bs, nb, (300 + bs - 1) // bs, g)
    q = torch.randn(lens.numel(), hq, d, generator=g).to(q_dtype)
    want = reference.paged_attention(q.float(), kc.float(), vc.float(), tables.int(),
                                     lens.int(), torch.arange(lens.numel() + 1, dtype=torch.int32),
                                     d ** -0.5)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = cpu_native.paged_decode(q, kc, vc, tables, lens, d ** -0.5)
        one = cpu_native.paged_decode(q[2:3], kc, vc, tables[2:3], lens[2:3], d ** -0.5)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one, want[2:3], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAS_CC, reason="no C compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("last", [299, 150])
def test_native_decode_softmax_max_covers_every_key(dtype, last):
    """One key scores ~160 above the rest (exp of that overflows float32 unless the max
    taken before the exponentials includes it), at a tail position past the last full
    16-key vector and at one inside it: the output is that key's value row, not NaN."""
    d, bs, nb, n = 64, 16, 40, 300
    g = torch.Generator().manual_seed(11)
    q = torch.randn(1, 1, d, generator=g)
    kc = (0.1 * torch.randn(nb, bs, 1, d, generator=g))
    vc = torch.randn(nb, bs, 1, d, generator=g)
    tables = torch.arange(nb).view(1, nb)
    kc.view(-1, d)[last] = 20 * q[0, 0]  # score = 20 |q|^2 / 8 ~ 160
    kc, vc = kc.to(dtype), vc.to(dtype)
    got = cpu_native.paged_decode(q.to(dtype), kc, vc, tables, torch.tensor([n]), d ** -0.5)
    torch.testing.assert_close(got[0, 0], vc.view(-1, d)[last].float(), rtol=1e-3, atol=1e-3)
