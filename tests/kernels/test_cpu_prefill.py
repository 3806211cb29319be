"""The native CPU prefill attention (kernels/cpu_paged_prefill.c via
kernels.cpu_native.paged_prefill) against the float64 oracle, and the engine's StepPlan
taking it for a mixed step: cached context, chunks that are not a multiple of the kernel's
tiles, GQA groups of 1-4, head sizes 64 and 128, block sizes 1-32, 1 and 2 threads."""

from __future__ import annotations

import shutil

import pytest
import torch

from kvscope.kernels import cpu_native, reference
from kvscope.kernels.cpu_attention import StepPlan

from .oracle import PagedBatch, dense_attention, make_batch

HAS_CC = bool(shutil.which("cc") or shutil.which("gcc"))
pytestmark = pytest.mark.skipif(not HAS_CC, reason="no C compiler: native kernels not built")


def _can_run(dtype: torch.dtype, head_dim: int) -> bool:
    lib = cpu_native.paged_prefill_kernel()
    assert lib is not None, "the native prefill kernel did not build"
    return bool(lib.kvscope_paged_prefill_supported(int(dtype == torch.bfloat16), head_dim))


def _need(dtype: torch.dtype, head_dim: int) -> None:
    if not _can_run(dtype, head_dim):
        pytest.skip(f"this CPU lacks the instructions for {dtype} prefill (AVX-512"
                    f"{', BF16' if dtype == torch.bfloat16 else ''})")


def _spans(b: PagedBatch) -> torch.Tensor:
    cu = b.cu_seqlens_q.long()
    return torch.stack([cu[:-1], cu[1:] - cu[:-1], b.seq_lens.long()]).contiguous()


def _run(b: PagedBatch, out_dtype: torch.dtype, threads: int,
         window: int | None = None) -> torch.Tensor:
    out = torch.full(b.q.shape, float("nan"), dtype=out_dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cpu_native.paged_prefill(b.q, b.k_cache, b.v_cache, b.block_tables.long().contiguous(),
                                 _spans(b), b.q.shape[2] ** -0.5, out, window=window)
    finally:
        torch.set_num_threads(before)
    return out


# (q heads, kv heads, head dim, block size)
SHAPES = [(9, 3, 64, 16), (8, 2, 128, 4), (4, 4, 64, 1), (6, 2, 64, 32), (8, 2, 64, 16)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_float32_prefill_equals_the_oracle(shape, threads):
    """Fresh prompts, chunks after cached context (a chunk of 1, one past a tile edge, one
    longer than a key block) in one call: float32 to float32 rounding."""
    hq, hkv, d, bs = shape
    _need(torch.float32, d)
    b = make_batch([37, 300, 17, 64, 33], [37, 45, 1, 33, 17], hq, hkv, d, bs, seed=hq + bs)
    got = _run(b, torch.float32, threads)
    torch.testing.assert_close(got.double(), dense_attention(b, d ** -0.5),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES[:3])
@pytest.mark.parametrize("threads", [1, 2])
def test_bfloat16_prefill_is_within_its_rounding(shape, threads):
    """bfloat16 q and pages: exact products, float32 sums, softmax weights rounded to
    bfloat16 for P.V. Against the oracle on the same bfloat16 values the float32 output is
    within a few bfloat16 ulps of each weight; the bfloat16 output adds its own rounding."""
    hq, hkv, d, bs = shape
    _need(torch.bfloat16, d)
    b = make_batch([37, 300, 17, 64, 33], [37, 45, 1, 33, 17], hq, hkv, d, bs,
                   dtype=torch.bfloat16, seed=hq + bs)
    want = dense_attention(b, d ** -0.5)
    got32 = _run(b, torch.float32, threads)
    torch.testing.assert_close(got32.double(), want, rtol=0, atol=6e-3)
    got16 = _run(b, torch.bfloat16, threads)
    torch.testing.assert_close(got16.double(), want, rtol=1e-2, atol=1e-2)
    # the float32 result rounded is the bfloat16 result (same kernel, one final rounding)
    torch.testing.assert_close(got16, got32.bfloat16(), rtol=0, atol=0)


def test_peaked_scores_across_key_blocks():
    """Scores that peak in a late key block (the running max moves up and old weights are
    rescaled) and rows whose keys all sit in the first block: float32, tight."""
    _need(torch.float32, 64)
    b = make_batch([200, 70], [120, 70], 4, 2, 64, 16, seed=3)
    b.k_cache.mul_(4)  # large logits: exp underflows unless the max is tracked exactly
    b.keys = [k * 4 for k in b.keys]
    got = _run(b, torch.float32, 2)
    torch.testing.assert_close(got.double(), dense_attention(b, 64 ** -0.5),
                               rtol=1e-5, atol=1e-5)


def test_declines_what_it_cannot_read():
    """Quantized pages, a query of another dtype, and head sizes that are not a multiple of
    64 take the torch path."""
    q = torch.zeros(4, 4, 64)
    pages = torch.zeros(8, 4, 2, 64)
    assert not cpu_native.supports_prefill(q, pages.to(torch.uint8), pages.to(torch.uint8))
    assert not cpu_native.supports_prefill(q.bfloat16(), pages, pages)
    assert not cpu_native.supports_prefill(torch.zeros(4, 4, 16), pages[..., :16].contiguous(),
                                           pages[..., :16].contiguous())


def _windowed_reference(b: PagedBatch, window: int) -> torch.Tensor:
    return reference.paged_attention(b.q.float(), b.k_cache.float(), b.v_cache.float(),
                                     b.block_tables, b.seq_lens, b.cu_seqlens_q,
                                     b.q.shape[2] ** -0.5, window=window)


@pytest.mark.parametrize("shape", SHAPES[:3])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("window", [1, 33, 100])
def test_float32_prefill_with_a_window_equals_the_reference(shape, threads, window):
    """Sliding windows inside one key block, on a block edge and across blocks; fresh
    prompts and chunks after cached context longer and shorter than the window. Every page
    wholly before a prefill's first query's window is NaN: one read of it would show."""
    hq, hkv, d, bs = shape
    _need(torch.float32, d)
    b = make_batch([37, 300, 17, 64, 200], [37, 45, 1, 33, 130], hq, hkv, d, bs, seed=window)
    want = _windowed_reference(b, window)
    cu = b.cu_seqlens_q.long()
    for s, n in enumerate(b.seq_lens.tolist()):
        q_len = int(cu[s + 1] - cu[s])
        before = max(n - q_len + 1 - window, 0) // bs  # pages wholly before the first window
        b.k_cache[b.block_tables[s, :before].long()] = float("nan")
        b.v_cache[b.block_tables[s, :before].long()] = float("nan")
    got = _run(b, torch.float32, threads, window=window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [5, 40])
def test_bfloat16_prefill_with_a_window_is_within_its_rounding(window):
    _need(torch.bfloat16, 64)
    b = make_batch([37, 300, 64], [37, 45, 33], 9, 3, 64, 16, dtype=torch.bfloat16, seed=2)
    torch.testing.assert_close(_run(b, torch.float32, 2, window=window),
                               _windowed_reference(b, window), rtol=0, atol=6e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7, 40])
def test_step_plan_takes_the_native_prefill(dtype, window, monkeypatch):
    """A mixed step at the model's head size (decodes, a chunk after cached context, a fresh
    prompt, a padding slot): StepPlan writes the pages and attends through the native prefill
    kernel, with a sliding-window layer's window too; outputs and pages match the reference,
    and the kernel was called."""
    _need(dtype, 64)
    hq, hkv, d, bs, nb = 9, 3, 64, 16, 40
    g = torch.Generator().manual_seed(11)
    seq_lens, q_lens = [5, 40, 19, 50, 31], [1, 1, 1, 20, 31]
    perm = torch.randperm(nb, generator=g)
    tables, slots, used = [], [], 0
    for n, ql in zip(seq_lens, q_lens, strict=True):
        own = perm[used:used + (n + bs - 1) // bs]
        used += own.numel()
        tables.append(torch.cat([own, torch.zeros(4 - own.numel(), dtype=own.dtype)]))
        slots += [int(own[p // bs]) * bs + p % bs for p in range(n - ql, n)]
    q_lens[-1] += 1  # a padding token rides with the last prompt (slot -1, never written)
    seq_lens[-1] += 1
    slots.append(-1)
    tables_t = torch.stack(tables).int()
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    t = sum(q_lens)
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    q = torch.randn(t, hq, d, generator=g).to(dtype)
    k = torch.randn(t, hkv, d, generator=g).to(dtype)
    v = torch.randn(t, hkv, d, generator=g).to(dtype)
    calls = []
    real = cpu_native.paged_prefill
    monkeypatch.setattr(cpu_native, "paged_prefill",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    plan = StepPlan(torch.tensor(slots), tables_t, lens_t, cu, bs, nb)
    got = plan.forward(q, k, v, kc, vc, d ** -0.5, window=window)
    assert calls, "the native prefill kernel was not used"
    reference.reshape_and_cache(k, v, kc_ref, vc_ref, torch.tensor(slots))
    want = reference.paged_attention(q.float(), kc_ref.float(), vc_ref.float(), tables_t,
                                     lens_t, cu, d ** -0.5, window=window)
    assert got.dtype == dtype
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    # the padding row's output is undefined (its key was never written): compare the rest
    torch.testing.assert_close(got[:-1].float(), want[:-1], rtol=tol, atol=tol)
