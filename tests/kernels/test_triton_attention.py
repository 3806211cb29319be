"""Triton paged attention against the torch reference (interpreter on CPU, tiny shapes).

Every batch comes from ``make_batch``: pages shuffled over the pool and table padding
pointing at a live page, so a kernel that reads the wrong page or past seq_len fails.
Block size 8 makes k*BS, k*BS +- 1 cheap to reach.
"""

from __future__ import annotations

import pytest
import torch

from kvscope import kernels
from tests.kernels.compare import assert_close, reference_attention, triton_attention
from tests.kernels.oracle import dense_attention, make_batch

BS = 8
RAGGED = [1, BS - 1, BS, BS + 1, 2 * BS, 3 * BS - 1, 3 * BS + 1]  # 1 and page boundaries


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_ragged_lengths(group, head_dim, dtype, device):
    num_kv_heads = 2 if group < 8 else 1
    batch = make_batch(RAGGED, [1] * len(RAGGED), group * num_kv_heads, num_kv_heads,
                       head_dim, BS, dtype=dtype, seed=group + head_dim)
    scale = head_dim ** -0.5
    got = triton_attention(batch, device, scale)
    assert_close(got, reference_attention(batch, scale), dtype)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_split_counts_including_more_splits_than_tiles(num_splits, device):
    # max_seq_len 40 = 5 pages: with 8 splits each split is one key tile rounded up, so the
    # short sequences leave most splits empty (lse = -inf) and the reduction must drop them.
    batch = make_batch([5, 8, 40], [1, 1, 1], 6, 2, 64, BS, seed=num_splits)
    got = triton_attention(batch, device, 0.125, num_splits=num_splits)
    assert_close(got, reference_attention(batch, 0.125), torch.float32)


@pytest.mark.parametrize("max_seq_len", [45, 10], ids=["exact", "underestimate"])
def test_decode_explicit_max_seq_len_and_bf16_pages(max_seq_len, device):
    # 2 splits sized for 10 keys (rounded up to whole key tiles) cover < 45 keys: the last
    # split must still run to seq_len.
    batch = make_batch([3, 17, 45], [1, 1, 1], 3, 1, 64, BS, dtype=torch.bfloat16, seed=7)
    got = triton_attention(batch, device, 0.125, max_seq_len=max_seq_len, num_splits=2)
    assert_close(got, reference_attention(batch, 0.125), torch.bfloat16)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_prefill_with_cached_context(group, device):
    # Prefix hits: context of whole pages (16, 24) and a context ending mid-page (23).
    seq_lens, q_lens = [24, 33, 30], [8, 9, 7]
    batch = make_batch(seq_lens, q_lens, group, 1, 80, BS, seed=group)
    got = triton_attention(batch, device, 0.1)
    want = reference_attention(batch, 0.1)
    assert_close(got, want, torch.float32)
    torch.testing.assert_close(got.double(), dense_attention(batch, 0.1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_batch_decode_prefill_and_fresh_prompt(dtype, device):
    seq_lens, q_lens = [17, 12, 1, 9, 16], [1, 12, 1, 4, 16]
    batch = make_batch(seq_lens, q_lens, 6, 2, 64, BS, dtype=dtype, seed=3)
    got = triton_attention(batch, device, 0.125)
    assert_close(got, reference_attention(batch, 0.125), dtype)


def test_fp16_pages_with_fp32_queries(device):
    batch = make_batch([9, 20], [3, 1], 4, 2, 64, BS, dtype=torch.float16,
                       q_dtype=torch.float32, seed=11)
    got = triton_attention(batch, device, 0.125)
    assert got.dtype == torch.float32
    assert_close(got, reference_attention(batch, 0.125), torch.float32)


@pytest.mark.parametrize("q_lens", [[1, 1], [2, 5]], ids=["decode", "prefill"])
def test_strided_query_and_preallocated_out(q_lens, device):
    """q sliced out of a fused qkv projection (row stride != Hq*D); result into ``out``."""
    batch = make_batch([13, 21], q_lens, 3, 1, 64, BS, seed=5)
    qkv = torch.randn(batch.q.shape[0], 5, 64)
    qkv[:, :3] = batch.q
    batch.q = qkv[:, :3]
    assert not batch.q.is_contiguous()
    dev = batch.to(device)
    out = torch.full_like(dev.q, float("nan")).contiguous()
    with kernels.force_backend("triton"):
        ret = kernels.paged_attention(dev.q, dev.k_cache, dev.v_cache, dev.block_tables,
                                      dev.seq_lens, dev.cu_seqlens_q, 0.125, out=out)
    assert ret is out
    assert_close(out.cpu(), reference_attention(batch, 0.125), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_chunked_prefill_equals_full_prefill(dtype, device):
    """Prefill a 37-token prompt at once, or as chunks of 16 + 21 written through
    reshape_and_cache between the chunks: the same outputs (and both match the oracle)."""
    gen = torch.Generator().manual_seed(0)
    n, hq, hkv, d, num_blocks = 37, 6, 2, 64, 8
    q = torch.randn(n, hq, d, generator=gen).to(dtype).to(device)
    k = torch.randn(n, hkv, d, generator=gen).to(dtype).to(device)
    v = torch.randn(n, hkv, d, generator=gen).to(dtype).to(device)
    table = torch.tensor([[6, 1, 4, 0, 3]], dtype=torch.int32, device=device)
    slots = (table[0].long()[:, None] * BS + torch.arange(BS, device=device)).flatten()[:n]

    def empty_cache():
        return torch.zeros(num_blocks, BS, hkv, d, dtype=dtype, device=device)

    def step(kc, vc, lo, hi):
        cu = torch.tensor([0, hi - lo], dtype=torch.int32, device=device)
        lens = torch.tensor([hi], dtype=torch.int32, device=device)
        kernels.reshape_and_cache(k[lo:hi], v[lo:hi], kc, vc, slots[lo:hi])
        return kernels.paged_attention(q[lo:hi], kc, vc, table, lens, cu, 0.125)

    with kernels.force_backend("triton"):
        full = step(empty_cache(), empty_cache(), 0, n)
        kc, vc = empty_cache(), empty_cache()
        chunked = torch.cat([step(kc, vc, 0, 16), step(kc, vc, 16, n)])
    assert_close(chunked.cpu(), full.cpu(), dtype)
    causal = torch.ones(n, n).tril().bool()
    scores = torch.einsum("qhd,khd->hqk", q.double().cpu(),
                          k.double().cpu().repeat_interleave(3, 1)) * 0.125
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    oracle = torch.einsum("hqk,khd->qhd", probs, v.double().cpu().repeat_interleave(3, 1))
    assert_close(full.cpu(), oracle.to(dtype), dtype)


def test_shape_errors_raise_before_launch(device):
    batch = make_batch([9], [1], 4, 2, 64, BS).to(device)
    with kernels.force_backend("triton"):
        with pytest.raises(ValueError, match="not a multiple"):
            kernels.paged_attention(batch.q[:, :3], batch.k_cache, batch.v_cache,
                                    batch.block_tables, batch.seq_lens, batch.cu_seqlens_q, 1.0)
        with pytest.raises(ValueError, match="cu_seqlens_q"):
            kernels.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                    batch.seq_lens, batch.cu_seqlens_q[:1], 1.0)
        with pytest.raises(ValueError, match="num_splits"):
            kernels.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                    batch.seq_lens, batch.cu_seqlens_q, 1.0, num_splits=0)


def test_decode_launch_options_hold_only_within_the_block():
    """The GPU check's launch sweep varies the decode kernel's warps and stages; the
    engine's launches must be Triton's defaults again afterwards, also after an error."""
    from kvscope.kernels import triton_attention as ta

    with ta.decode_launch(num_warps=8, num_stages=2):
        assert ta._DECODE_LAUNCH == {"num_warps": 8, "num_stages": 2}
        with pytest.raises(RuntimeError), ta.decode_launch(num_warps=4):
            assert ta._DECODE_LAUNCH == {"num_warps": 4, "num_stages": 2}
            raise RuntimeError("a failing probe")
        assert ta._DECODE_LAUNCH == {"num_warps": 8, "num_stages": 2}
    assert ta._DECODE_LAUNCH == {}
    with pytest.raises(ValueError, match="unknown launch options"), ta.decode_launch(
            num_ctas=2):
        pass
