"""Mixed-precision arenas on the torch reference: layout arithmetic, demotion writes the
codes kernels.quant would write, and attention over every mix of page formats equals
dequantize-then-attend."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvscope.kernels import block_quant as bq
from kvscope.kernels import mixed_pages as mp
from kvscope.kernels import quant, reference
from tests.mixed.arena import block_page_reads, filled_arena

BS, HKV, HQ, D = 4, 2, 4, 16
MIXES = [m for r in (1, 2, 3) for m in itertools.combinations(("full", "int8", "int4"), r)]
BLOCK_MIXES = [("full", "int8", "kivi4"), ("k8v4", "full"), ("int4", "kivi2")]


def test_layout_counts_pages_per_frame_and_bytes():
    bf16 = mp.MixedLayout(torch.bfloat16, 16, 3, 64)
    assert (bf16.subs("full"), bf16.subs("int8"), bf16.subs("int4")) == (1, 2, 4)
    assert bf16.scale_params == 8 and bf16.frame_bytes == 2 * 16 * 3 * (128 + 16)  # K + V
    fp32 = mp.MixedLayout(torch.float32, 16, 3, 64, ("int8",))
    assert (fp32.subs("int8"), fp32.max_subs, fp32.scale_params) == (4, 4, 4)
    views = fp32.views(fp32.allocate(3, "cpu")[0])
    assert views["full"].shape == (3, 16, 3, 64) and views["int8"].shape == (3, 16, 3, 4, 64)
    with pytest.raises(ValueError, match="int8, int4 or one of"):
        mp.MixedLayout(torch.float32, 16, 3, 64, ("fp8",))
    with pytest.raises(ValueError, match="at most one block"):
        mp.MixedLayout(torch.float32, 16, 3, 64, ("k8v4", "kivi2"))
    # Block formats: pages per frame by the wider codes; K's scale columns hold 8 pages'
    # per-channel pairs (3 heads x 64 channels x 12 bits) and fp16 supers (3 x 4 bytes).
    kivi = mp.MixedLayout(torch.float32, 16, 3, 64, ("int8", "kivi4"))
    assert (kivi.subs("kivi4"), kivi.max_subs) == (8, 8)
    assert mp.MixedLayout(torch.float32, 16, 3, 64, ("k8v4",)).subs("k8v4") == 4
    assert mp.MixedLayout(torch.bfloat16, 16, 3, 64, ("kivi2",)).subs("kivi2") == 8
    assert kivi.side_bytes("k") == 3 * 96 + 12 and kivi.side_bytes("v") == 16 * 3 * 2 + 12
    assert kivi.scale_params_of("k") == 25 and kivi.scale_params_of("v") == 9
    assert kivi.frame_bytes == 16 * 3 * (2 * 256 + 2 * 25 + 2 * 9)


def _pattern(mix: tuple[str, ...], n: int) -> list[str]:
    return [mix[i % len(mix)] for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix", MIXES, ids=["+".join(m) for m in MIXES])
def test_attention_over_every_mix_equals_dequantize_then_attend(mix, dtype):
    fa = filled_arena(_pattern(mix, 9), dtype, BS, HKV, D, seed=len(mix))
    tables = torch.tensor([[5, 0, 7, 2], [3, 6, 8, 1], [4, 0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([13, 16, 3], dtype=torch.int32)
    gen = torch.Generator().manual_seed(7)
    for q_lens in ([13, 4, 1], [1, 1, 1]):
        cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
        q = torch.randn(int(cu[-1]), HQ, D, generator=gen).to(dtype)
        want = reference.paged_attention(q.float(), fa.k_want, fa.v_want, tables, lens, cu,
                                         0.25)
        got = mp.paged_attention(q, fa.layout, fa.k, fa.v, fa.ks, fa.vs,
                                 fa.code_tables(tables), lens, cu, 0.25)
        tol = 2e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix", BLOCK_MIXES, ids=["+".join(m) for m in BLOCK_MIXES])
def test_attention_over_block_format_pages_equals_dequantize_then_attend(mix, dtype):
    enabled = tuple(f for f in mix if f != "full")
    fa = filled_arena(_pattern(mix, 9), dtype, BS, HKV, D, seed=11, enabled=enabled)
    tables = torch.tensor([[5, 0, 7, 2], [3, 6, 8, 1], [4, 0, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([13, 16, 3], dtype=torch.int32)
    gen = torch.Generator().manual_seed(3)
    for q_lens in ([13, 4, 1], [1, 1, 1]):
        cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
        q = torch.randn(int(cu[-1]), HQ, D, generator=gen).to(dtype)
        want = reference.paged_attention(q.float(), fa.k_want, fa.v_want, tables, lens, cu,
                                         0.25)
        got = mp.paged_attention(q, fa.layout, fa.k, fa.v, fa.ks, fa.vs,
                                 fa.code_tables(tables), lens, cu, 0.25)
        tol = 2e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", ["kivi4", "k8v4", "kivi2"])
def test_demotion_writes_the_block_format_codes_bit_for_bit(name):
    """The sub-page's codes, scale pairs and fp16 supers are exactly what
    kernels.block_quant writes for the rotated block (what a --kv-cache-dtype page holds)."""
    fmt = bq.FORMATS[name]
    lay = mp.MixedLayout(torch.float32, BS, HKV, D, ("int8", name))
    k, ks = lay.allocate(4, "cpu", "k")
    v, vs = lay.allocate(4, "cpu", "v")
    gen = torch.Generator().manual_seed(2)
    kx = torch.randn(BS, HKV, D, generator=gen) * 3
    vx = torch.randn(BS, HKV, D, generator=gen)
    lay.views(k)["full"][1], lay.views(v)["full"][1] = kx, vx
    sub = lay.subs(name) - 1  # the last sub-page: offsets at their largest
    src = torch.tensor([lay.code(1, 0, "full")])
    dst = torch.tensor([lay.code(2, sub, name)])
    mp.demote(lay, k, ks, src, dst, "k")
    mp.demote(lay, v, vs, src, dst, "v")
    h = quant.hadamard(D)
    for kind, arena, scales, x, quantize in (("k", k, ks, kx, bq.quantize_keys),
                                             ("v", v, vs, vx, bq.quantize_values)):
        codes, pairs, supers = quantize(x[None] @ h, fmt)
        w = lay.code_width(kind)
        assert torch.equal(arena[2, :, :, sub * w:(sub + 1) * w], codes[0]), kind
        side = lay.side_bytes(kind)
        got = scales[2].view(torch.uint8).flatten()[sub * side:(sub + 1) * side]
        want = torch.cat([pairs.flatten(), supers.contiguous().view(torch.uint8).flatten()])
        assert torch.equal(got, want), kind
        # nothing else of frame 2 was written
        assert not arena[2, :, :, :sub * w].any() and not arena[2, :, :, (sub + 1) * w:].any()
        assert not scales[2].view(torch.uint8).flatten()[:sub * side].any()


def test_an_undemoted_arena_computes_exactly_what_a_plain_pool_computes():
    fa = filled_arena(["full"] * 6, torch.float32, BS, HKV, D, seed=3)
    tables = torch.tensor([[5, 0, 2], [3, 1, 4]], dtype=torch.int32)
    lens = torch.tensor([11, 9], dtype=torch.int32)
    cu = torch.tensor([0, 11, 12], dtype=torch.int32)
    q = torch.randn(12, HQ, D)
    want = reference.paged_attention(q, fa.k_want, fa.v_want, tables, lens, cu, 0.25)
    got = mp.paged_attention(q, fa.layout, fa.k, fa.v, fa.ks, fa.vs, fa.code_tables(tables),
                             lens, cu, 0.25)
    assert torch.equal(got, want)


def test_demotion_from_int8_to_int4_requantizes_the_dequantized_page():
    fa = filled_arena(["int8", "full"], torch.float32, BS, HKV, D, seed=5)
    lay = fa.layout
    src = torch.tensor([fa.codes[0]])
    dst = torch.tensor([lay.code(4, 3, "int4")])
    before = mp.read_pages(lay, fa.k, fa.ks, src, torch.float32)
    mp.demote(lay, fa.k, fa.ks, src, dst)
    after = mp.read_pages(lay, fa.k, fa.ks, dst, torch.float32)
    c, s = quant.quantize(before[0], "int4")
    torch.testing.assert_close(after[0], quant.dequantize(c, s, "int4"))


def test_demotion_from_int8_to_kivi2_requantizes_the_dequantized_page():
    fa = filled_arena(["int8", "full"], torch.float32, BS, HKV, D, seed=5,
                      enabled=("int8", "kivi2"))
    lay = fa.layout
    src = torch.tensor([fa.codes[0]])
    dst = torch.tensor([lay.code(4, lay.subs("kivi2") - 1, "kivi2")])
    before = [mp.read_pages(lay, a, s, src, torch.float32, kind)
              for kind, a, s in (("k", fa.k, fa.ks), ("v", fa.v, fa.vs))]
    for kind, a, s in (("k", fa.k, fa.ks), ("v", fa.v, fa.vs)):
        mp.demote(lay, a, s, src, dst, kind)
    want = block_page_reads(before[0][0], before[1][0], bq.FORMATS["kivi2"])
    for kind, a, s, w in (("k", fa.k, fa.ks, want[0]), ("v", fa.v, fa.vs, want[1])):
        torch.testing.assert_close(mp.read_pages(lay, a, s, dst, torch.float32, kind)[0], w)


def test_bad_page_codes_are_rejected_before_reading():
    fa = filled_arena(["full", "int8"], torch.float32, BS, HKV, D, enabled=("int8",))
    lens = torch.tensor([8], dtype=torch.int32)
    cu = torch.tensor([0, 1], dtype=torch.int32)
    q = torch.randn(1, HQ, D)
    for bad in (fa.layout.code(1, 0, "int4"), fa.layout.code(99, 0, "full"), 1):
        table = torch.tensor([[fa.codes[0], bad]], dtype=torch.int32)
        with pytest.raises(ValueError, match="name no page"):
            mp.paged_attention(q, fa.layout, fa.k, fa.v, fa.ks, fa.vs, table, lens, cu, 0.25)


def test_stale_bytes_past_a_sequence_end_do_not_reach_its_decode():
    """A frame reused as a full page keeps its old bytes past the tokens written so far (in
    a mixed arena, int4/int8 codes, which read as fp32 can be NaN): decode must not see
    them (they once turned whole answers into NaN logits, docs/benchmarks/quant.md)."""
    lay = mp.MixedLayout(torch.float32, 4, 1, 8, ("int4",))
    k, ks = lay.allocate(2, "cpu", "k")
    v, vs = lay.allocate(2, "cpu", "v")
    kx, vx = torch.randn(2, 1, 8), torch.randn(2, 1, 8)
    lay.views(k)["full"][0, :2], lay.views(v)["full"][0, :2] = kx, vx
    k[0, 2:], v[0, 2:] = 0xFF, 0xFF  # NaN as fp32
    q = torch.randn(1, 1, 8)
    got = mp.paged_attention(q, lay, k, v, ks, vs,
                             torch.tensor([[lay.code(0, 0, "full")]], dtype=torch.int32),
                             torch.tensor([2], dtype=torch.int32),
                             torch.tensor([0, 1], dtype=torch.int32), 0.3)
    p = ((q[0] @ kx[:, 0].T) * 0.3).softmax(-1)
    torch.testing.assert_close(got[0], p @ vx[:, 0])
