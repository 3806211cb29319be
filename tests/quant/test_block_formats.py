"""Block-quantized pages (kernels.block_quant, engine.runner.block_kv): codes and scales bit
for bit against a scalar numpy reference, the half-step error bound, the residual window's
life cycle, and attention over the pages against dense attention over what they hold."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvscope.engine.runner.block_kv import BlockKV, BlockPagedAttention
from kvscope.engine.runner.model_runner import StepBatch
from kvscope.kernels import block_quant as bq

FORMATS = list(bq.FORMATS.values())
BS, HKV, D = 8, 2, 16


def _keys(n: int, seed: int = 0) -> torch.Tensor:
    """Blocks [n, BS, HKV, D] with an outlier channel and a channel offset, as real keys."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, BS, HKV, D, generator=g)
    x[..., 3] *= 18.0
    x[..., 5] += 9.0
    return x


_UP = np.float32(1 + 2.0 ** -10)


def _fp16_up(x: np.float32) -> np.float16:
    return np.float16(np.clip(np.float32(x * _UP), np.float32(2.0 ** -14), np.float32(65504)))


def _ref_family(groups: list[np.ndarray], bits: int, pair_bits: int = 8
                ) -> tuple[list[list[int]], list[list[int]], list[float]]:
    """One (block, head)'s groups -> (codes per group, (c, z) per group, [smax, zstep]),
    scalar numpy float32 arithmetic as documented in kernels.block_quant (pair codes of
    ``pair_bits``: 8 -> 2^(-c/16), zero (z - 128); 6 -> 2^(-c/8), zero (z - 32))."""
    levels = np.float32((1 << bits) - 1)
    steps, zmax = {8: (16, 127), 6: (8, 31)}[pair_bits]
    table = bq.scale_table(pair_bits).numpy()  # the factors both sides read
    np.testing.assert_allclose(table, np.exp2(-np.arange(1 << pair_bits) / steps), rtol=1e-6)
    lo = [np.float32(g.min()) for g in groups]
    hi = [np.float32(g.max()) for g in groups]
    zstep = _fp16_up(np.float32(max(abs(v) for v in lo) / np.float32(zmax)))
    zs = np.float32(zstep)
    z = [int(np.floor(v / zs)) for v in lo]
    z = [k - 1 if np.float32(k) * zs > v else k for k, v in zip(z, lo, strict=True)]
    zero = [np.float32(k) * zs for k in z]
    need = [np.float32(np.float32(h - o) / levels) for h, o in zip(hi, zero, strict=True)]
    smax = _fp16_up(max(need))
    sm = np.float32(smax)
    c = [max(i for i in range(1 << pair_bits) if np.float32(table[i] * sm) >= n) for n in need]
    codes = []
    for g, ci, o in zip(groups, c, zero, strict=True):
        scale = np.float32(table[ci] * sm)
        codes.append([int(np.clip(np.floor(np.float32(np.float32(np.float32(v) - o) / scale) +
                                           np.float32(0.5)), 0, levels)) for v in g])
    off = 1 << (pair_bits - 1)
    return codes, [[ci, k + off] for ci, k in zip(c, z, strict=True)], [float(smax), float(zstep)]


def _ref_pack_pairs6(pairs: list[list[int]]) -> list[list[int]]:
    """(c, z) per channel, 6-bit codes -> 3 bytes per two channels, little-endian bits
    c0 | z0 << 6 | c1 << 12 | z1 << 18."""
    out = []
    for j in range(0, len(pairs), 2):
        (c0, z0), (c1, z1) = pairs[j], pairs[j + 1]
        v = c0 | z0 << 6 | c1 << 12 | z1 << 18
        out.append([v & 255, (v >> 8) & 255, v >> 16])
    return out


def _ref_pack(codes: list[int], bits: int) -> list[int]:
    per = 8 // bits
    return [sum(codes[j * per + i] << (bits * i) for i in range(per))
            for j in range(len(codes) // per)]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_key_codes_and_scales_match_the_scalar_reference_bit_for_bit(fmt):
    x = _keys(2)
    codes, scales, supers = bq.quantize_keys(x, fmt)
    xn = x.numpy()
    for n in range(2):
        for h in range(HKV):
            if fmt.keys_per_channel:
                cc, pairs, sup = _ref_family([xn[n, :, h, c] for c in range(D)], fmt.key_bits,
                                             fmt.key_pair_bits)
                if fmt.key_pair_bits == 6:
                    pairs = _ref_pack_pairs6(pairs)
                assert scales[n, h].tolist() == pairs
                for t in range(BS):
                    row = [cc[c][t] for c in range(D)]
                    assert codes[n, t, h].tolist() == _ref_pack(row, fmt.key_bits)
            else:
                cc, pairs, sup = _ref_family([xn[n, t, h] for t in range(BS)], fmt.key_bits)
                assert scales[n, :, h].tolist() == pairs
                for t in range(BS):
                    assert codes[n, t, h].tolist() == _ref_pack(cc[t], fmt.key_bits)
            assert supers[n, h].tolist() == sup


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_value_codes_and_scales_match_the_scalar_reference_bit_for_bit(fmt):
    x = _keys(1, seed=1)
    codes, scales, supers = bq.quantize_values(x, fmt)
    for h in range(HKV):
        cc, pairs, sup = _ref_family([x[0, t, h].numpy() for t in range(BS)], fmt.value_bits)
        assert scales[0, :, h].tolist() == pairs and supers[0, h].tolist() == sup
        for t in range(BS):
            assert codes[0, t, h].tolist() == _ref_pack(cc[t], fmt.value_bits)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_every_element_is_within_half_a_step(fmt):
    x = _keys(3, seed=2)
    x[1, :, 0] = 0.5  # a constant block-head: every group's range is 0
    codes, scales, supers = bq.quantize_keys(x, fmt)
    err = (bq.dequantize_keys(codes, scales, supers, fmt) - x).abs()
    assert bool((err <= bq.key_step(scales, supers, fmt) / 2 * (1 + 1e-5)).all())
    codes, scales, supers = bq.quantize_values(x, fmt)
    err = (bq.dequantize_values(codes, scales, supers, fmt) - x).abs()
    assert bool((err <= bq.value_step(scales, supers) / 2 * (1 + 1e-5)).all())


def test_per_channel_keys_follow_an_outlier_channel_better_than_per_token():
    x = _keys(4, seed=3)
    per_channel, per_token = bq.FORMATS["kivi4"], bq.BlockFormat("t", 4, 4, False, False)
    errs = []
    for fmt in (per_channel, per_token):
        q = bq.quantize_keys(x, fmt)
        errs.append(float((bq.dequantize_keys(*q, fmt) - x).pow(2).mean()))
    assert errs[0] < errs[1] / 2, errs


def test_capacities_count_codes_and_amortised_scales():
    # head 64, block 16: 4-bit codes 32 B; per-channel (c, z) bytes over 16 tokens
    # 64 * 2 / 16 = 8 B a token (kivi4's 12-bit pairs: 6 B); per-token pairs 2 B; K and V
    # supers 4 B each per block
    assert bq.FORMATS["kivi4"].bytes_per_token_head(64, 16) == (32 + 6 + 32 + 2 + 0.5) / 2
    assert 128 / bq.FORMATS["kivi4"].bytes_per_token_head(64, 16) >= 3.5
    assert bq.FORMATS["k8v4"].bytes_per_token_head(64, 16) == (64 + 2 + 32 + 2 + 0.5) / 2
    assert bq.FORMATS["kivi2"].bytes_per_token_head(64, 16) == (16 + 8 + 16 + 2 + 0.5) / 2
    assert 128 / bq.FORMATS["kivi2"].bytes_per_token_head(64, 16) >= 6
    with pytest.raises(ValueError, match="multiple"):
        bq.FORMATS["kivi2"].packed_dim(2, 6)
    with pytest.raises(ValueError, match="unknown"):
        bq.block_format("int3")
    with pytest.raises(ValueError, match="per-channel keys"):
        bq.BlockFormat("x", 8, 4, keys_per_channel=False, rotate_keys=True, key_pair_bits=6)


def _step(slots: list[int], table: list[list[int]], seq_lens: list[int],
          q_lens: list[int]) -> StepBatch:
    cu = np.cumsum([0, *q_lens]).tolist()
    return StepBatch(input_ids=torch.zeros(len(slots), dtype=torch.int64),
                     positions=torch.zeros(len(slots), dtype=torch.int64),
                     slot_mapping=torch.tensor(slots), block_tables=torch.tensor(table,
                                                                                  dtype=torch.int32),
                     seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                     cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
                     sample_index=torch.zeros(0, dtype=torch.int64))


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last q rows over k/v [L, HKV, D], GQA, plain float64."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, 1)
    v = v.double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    ctx = k.shape[0] - q.shape[0]
    mask = torch.arange(k.shape[0])[None, :] > torch.arange(q.shape[0])[:, None] + ctx
    s.masked_fill_(mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def _held(x: torch.Tensor, length: int, fmt: bq.BlockFormat, keys: bool) -> torch.Tensor:
    """What the pages hold for tokens x[:length]: complete blocks through their codes,
    the rest exact."""
    full = length // BS * BS
    out = x[:length].clone()
    if full:
        blocks = x[:full].view(-1, BS, HKV, D)
        if keys:
            out[:full] = bq.dequantize_keys(*bq.quantize_keys(blocks, fmt), fmt).flatten(0, 1)
        else:
            out[:full] = bq.dequantize_values(*bq.quantize_values(blocks, fmt),
                                              fmt).flatten(0, 1)
    return out


@pytest.mark.parametrize("name", list(bq.FORMATS))
def test_residual_window_then_block_codes_through_prefill_and_decode(name):
    """One sequence: a 13-token prefill (block 0 complete, block 1 in the residual), then
    decodes across the next block boundary; every step's attention equals dense attention
    over exact residual tokens and dequantized complete blocks (the rotation cancels)."""
    _prefill_then_decodes(name, BlockPagedAttention)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CPU pages under the Triton interpreter; a GPU runs the kernel "
                    "compiled in tests/kernels/test_triton_block_attention.py")
def test_steps_on_a_gpu_take_the_triton_kernel(monkeypatch):
    """The dispatch a GPU takes (kernels/triton_block_attention.py for the prefill and every
    decode step), here under the Triton interpreter: same answers."""
    from kvscope.kernels import cpu_block_decode, triton_block_attention

    calls = []
    kernel = triton_block_attention.block_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_block_attention, "block_attention", counted)
    monkeypatch.setattr(cpu_block_decode, "supports", lambda q, pages: False)

    class OnGpu(BlockPagedAttention):
        @staticmethod
        def _on_triton(q, pages):
            return True

    _prefill_then_decodes("kivi4", OnGpu)
    assert len(calls) == 8  # the prefill and every decode step


def _prefill_then_decodes(name: str, backend: type[BlockPagedAttention]) -> None:
    fmt = bq.FORMATS[name]
    kv = BlockKV(fmt, 1, 6, BS, HKV, D, torch.float32, torch.device("cpu"))
    attn = backend(kv, D ** -0.5, D)
    table = [[4, 1, 3]]  # the sequence's blocks, out of order in the pool
    g = torch.Generator().manual_seed(5)
    total = 20
    k_all = _keys(3, seed=6).flatten(0, 1)[:total]
    v_all = torch.randn(total, HKV, D, generator=g)
    q_all = torch.randn(total, 2 * HKV, D, generator=g)
    rot = bq.quant.hadamard(D)
    k_store = k_all @ rot if fmt.rotate_keys else k_all
    v_store = v_all @ rot if fmt.rotate_values else v_all
    pos = 0
    for q_len in (13, 1, 1, 1, 1, 1, 1, 1):
        new = range(pos, pos + q_len)
        slots = [table[0][t // BS] * BS + t % BS for t in new]
        attn.batch = _step(slots, table, [pos + q_len], [q_len])
        out = attn(0, q_all[pos:pos + q_len], k_all[pos:pos + q_len], v_all[pos:pos + q_len])
        length = pos + q_len
        # within the step that completes a block, the block is still read exactly
        before = pos // BS * BS
        k_held = torch.cat([_held(k_store, before, fmt, True)[:before], k_store[before:length]])
        v_held = torch.cat([_held(v_store, before, fmt, False)[:before], v_store[before:length]])
        if fmt.rotate_keys:
            k_held = k_held @ rot.T
        if fmt.rotate_values:
            v_held = v_held @ rot.T
        want = _dense(q_all[pos:length], k_held, v_held, D ** -0.5)
        torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)
        pos = length
        partial = int(length % BS != 0)
        assert kv.rows_in_use == partial  # completed blocks gave their rows back
    assert pos == total


def test_copy_on_write_carries_the_residual_row_and_the_codes():
    fmt = bq.FORMATS["kivi4"]
    kv = BlockKV(fmt, 2, 4, BS, HKV, D, torch.float32, torch.device("cpu"))
    attn = BlockPagedAttention(kv, D ** -0.5, D)
    x = _keys(2, seed=7).flatten(0, 1)[:12]  # block 0 complete, block 2 holds 4 tokens
    slots = [t if t < BS else 2 * BS + t - BS for t in range(12)]
    attn.batch = _step(slots, [[0, 2]], [12], [12])
    for layer in range(2):
        attn(layer, torch.randn(12, 2 * HKV, D), x, x)
    kv.copy([(0, 1), (2, 3)])
    for layer in kv.layers:
        k0, _ = layer.gather(torch.tensor([0, 2]), torch.float32)
        k1, _ = layer.gather(torch.tensor([1, 3]), torch.float32)
        assert torch.equal(k0, k1)
        stored = x @ bq.quant.hadamard(D) if fmt.rotate_keys else x
        assert torch.equal(k1[1, :4], stored[8:12])  # the residual: exact
    assert kv.rows_in_use == 2


def test_rows_grow_on_demand_and_a_reused_block_takes_its_stale_row():
    kv = BlockKV(bq.FORMATS["kivi2"], 1, 64, BS, HKV, D, torch.float32, torch.device("cpu"))
    writes = kv.plan_writes(torch.arange(20) * BS)  # 20 blocks, one token each
    assert kv.rows_in_use == 20 and kv.layers[0].residual_k.shape[0] >= 20
    again = kv.plan_writes(torch.tensor([3 * BS]))  # block 3 freed, reused from offset 0
    assert int(again.rows[0]) == int(writes.rows[3]) and kv.rows_in_use == 20
