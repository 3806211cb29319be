"""The torch reference (the engine's CPU path) against the dense oracle on larger shapes,
plus its cache writers, swap, and its rejection of bad input without touching state."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels import reference
from tests.kernels.compare import reference_attention
from tests.kernels.oracle import dense_attention, make_batch

HAS_CUDA = torch.cuda.is_available()


def _check(batch, scale, atol):
    got = reference_attention(batch, scale)
    assert got.dtype == batch.q.dtype
    torch.testing.assert_close(got.double(), dense_attention(batch, scale), atol=atol, rtol=atol)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_decode_batch_matches_oracle(group):
    gen = torch.Generator().manual_seed(group)
    seq_lens = torch.randint(1, 300, (12,), generator=gen).tolist() + [16, 32, 1]
    batch = make_batch(seq_lens, [1] * len(seq_lens), 3 * group, 3, 64, 16, seed=group)
    _check(batch, 0.125, 1e-5)


def test_mixed_batch_with_prefix_hits_matches_oracle():
    seq_lens = [200, 1, 65, 130, 48, 97]
    q_lens = [1, 1, 65, 30, 16, 1]  # decode, fresh prompts, prefix-hit chunks, decode
    batch = make_batch(seq_lens, q_lens, 9, 3, 80, 16, seed=1)
    _check(batch, 80 ** -0.5, 1e-5)


def test_prefill_with_and_without_cached_context_matches_oracle():
    # 50 of 90 tokens new (masked path, causal rule offset by 40); 40 of 40 (is_causal path)
    batch = make_batch([90, 40], [50, 40], 6, 2, 64, 16, seed=4)
    _check(batch, 0.125, 1e-5)


def test_agrees_with_the_models_contiguous_attention():
    """Same semantics (causal offset, GQA head mapping) as the model side's contiguous path."""
    from kvscope.kernels.contiguous import contiguous_attention

    batch = make_batch([70, 33], [20, 1], 9, 3, 64, 16, seed=6)
    got = reference_attention(batch, 0.125)
    cu = batch.cu_seqlens_q.tolist()
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        q = batch.q[cu[b]:cu[b + 1]]
        want = contiguous_attention(q, batch.keys[b], batch.values[b], seq_len - q.shape[0],
                                    0.125)
        torch.testing.assert_close(got[cu[b]:cu[b + 1]], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_half_pages_match_oracle_within_half_precision(dtype, tol):
    batch = make_batch([100, 37, 5], [1, 37, 2], 8, 2, 64, 16, dtype=dtype, seed=2)
    _check(batch, 0.125, tol)


def test_reshape_and_cache_writes_exactly_the_given_slots():
    k_cache = torch.zeros(5, 4, 2, 8)
    v_cache = torch.zeros(5, 4, 2, 8)
    key = torch.arange(4 * 2 * 8, dtype=torch.float32).view(4, 2, 8) + 1
    slots = torch.tensor([19, -1, 0, 6])
    reference.reshape_and_cache(key, -key, k_cache, v_cache, slots)
    assert torch.equal(k_cache[4, 3], key[0]) and torch.equal(v_cache[4, 3], -key[0])
    assert torch.equal(k_cache[0, 0], key[2]) and torch.equal(k_cache[1, 2], key[3])
    assert int((k_cache != 0).any(dim=(2, 3)).sum()) == 3  # padding token wrote nothing


def test_copy_blocks_snapshot_semantics():
    k = torch.arange(6.0).view(6, 1, 1, 1).expand(6, 2, 1, 4).clone()
    v = -k
    reference.copy_blocks([k], [v], torch.tensor([[1, 4], [2, 5]]))
    assert k[:, 0, 0, 0].tolist() == [0, 1, 2, 3, 1, 2]
    assert v[:, 0, 0, 0].tolist() == [0, -1, -2, -3, -1, -2]


def test_swap_blocks_between_pools_of_different_sizes():
    gpu_pool = torch.randn(10, 4, 2, 8)
    cpu_pool = torch.zeros(6, 4, 2, 8)
    mapping = torch.tensor([[7, 0], [2, 5], [9, 3]])
    reference.swap_blocks(gpu_pool, cpu_pool, mapping)  # out
    for src, dst in mapping.tolist():
        assert torch.equal(cpu_pool[dst], gpu_pool[src])
    assert cpu_pool[[1, 2, 4]].abs().sum() == 0
    back = torch.zeros_like(gpu_pool)
    reference.swap_blocks(cpu_pool, back, mapping.flip(1))  # and in again
    for src in mapping[:, 0].tolist():
        assert torch.equal(back[src], gpu_pool[src])


@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU: GPU <-> CPU swap")
def test_swap_blocks_gpu_cpu_round_trip():
    gpu_pool = torch.randn(10, 4, 2, 8, device="cuda", dtype=torch.float16)
    cpu_pool = torch.zeros(6, 4, 2, 8, dtype=torch.float16)
    mapping = torch.tensor([[7, 0], [2, 5]])
    reference.swap_blocks(gpu_pool, cpu_pool, mapping)
    back = torch.zeros_like(gpu_pool)
    reference.swap_blocks(cpu_pool, back, mapping.flip(1))
    torch.cuda.synchronize()
    assert torch.equal(back[[7, 2]], gpu_pool[[7, 2]])


def _bad_attention_inputs():
    batch = make_batch([9, 20], [2, 1], 4, 2, 64, 8)
    args = dict(q=batch.q, k_cache=batch.k_cache, v_cache=batch.v_cache,
                block_tables=batch.block_tables, seq_lens=batch.seq_lens,
                cu_seqlens_q=batch.cu_seqlens_q)
    i32 = dict(dtype=torch.int32)
    return [
        ("cu_seqlens_q must run", dict(cu_seqlens_q=torch.tensor([0, 2, 4], **i32))),
        ("q_len >= 1", dict(cu_seqlens_q=torch.tensor([0, 3, 3], **i32))),
        ("shorter than q_lens", dict(seq_lens=torch.tensor([1, 20], **i32))),
        ("needs 4 pages", dict(seq_lens=torch.tensor([9, 30], **i32))),
        ("block_tables out of range", dict(block_tables=batch.block_tables + 100)),
        ("not a multiple", dict(q=batch.q[:, :3])),
        ("int32/int64", dict(seq_lens=batch.seq_lens.float())),
        ("differ", dict(v_cache=batch.v_cache.half())),
    ], args


@pytest.mark.parametrize("case", range(8))
def test_bad_attention_input_raises_clearly(case):
    cases, args = _bad_attention_inputs()
    match, change = cases[case]
    with pytest.raises(ValueError, match=match):
        reference.paged_attention(**{**args, **change}, scale=1.0)


def test_bad_cache_write_inputs_leave_caches_untouched():
    k_cache, v_cache = torch.randn(3, 4, 2, 8), torch.randn(3, 4, 2, 8)
    before = (k_cache.clone(), v_cache.clone())
    key = torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping must be"):
        reference.reshape_and_cache(key, key, k_cache, v_cache, torch.tensor([1]))
    with pytest.raises(ValueError, match="key must be"):
        reference.reshape_and_cache(key[:, :1], key[:, :1], k_cache, v_cache,
                                    torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="block_mapping out of range"):
        reference.copy_blocks([k_cache], [v_cache], torch.tensor([[0, 1], [2, 3]]))
    with pytest.raises(ValueError, match=r"block_mapping must be \[N, 2\]"):
        reference.copy_blocks([k_cache], [v_cache], torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="same page shape and dtype"):
        reference.swap_blocks(k_cache, v_cache.half(), torch.tensor([[0, 1]]))
    with pytest.raises(ValueError, match=r"block_mapping\[:, 1\] out of range"):
        reference.swap_blocks(k_cache, v_cache, torch.tensor([[0, 1], [1, 3]]))
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])
