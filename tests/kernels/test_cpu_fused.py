"""The fused native CPU elementwise kernels (kernels/cpu_fused.c) against the torch code
they replace (engine.model.llama.rms_norm, RotaryEmbedding.apply), their fallback, and the
model forward with and without them."""

from __future__ import annotations

import pytest
import torch

from kvscope.engine.model.llama import rms_norm
from kvscope.engine.model.rope import RotaryEmbedding
from kvscope.kernels import cpu_fused, cpu_native

pytestmark = pytest.mark.skipif(cpu_fused.library() is None,
                                reason="no C compiler: the fused kernels cannot be built")

DTYPES = (torch.float32, torch.bfloat16)
# (rows, width): one decode token, odd widths, and enough rows to take the OpenMP path
SHAPES = ((1, 576), (3, 5), (2, 33), (70, 577))


@pytest.fixture
def two_threads():
    """The kernels split rows over torch's intra-op threads: exercise the parallel path."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _exact_sum_rows(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of small integers times a power of two: their squares add up exactly in float32
    in any order, so the kernel and torch must agree bit for bit (no reduction-order slack)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-16, 17, (rows, width), generator=gen).float() / 8).to(dtype)


def _weight(width: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(width)
    return (1 + 0.3 * torch.randn(width, generator=gen)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", SHAPES)
def test_rms_norm_is_bit_exact_when_the_sum_of_squares_is(dtype, rows, width, two_threads):
    x, w = _exact_sum_rows(rows, width, dtype, seed=rows), _weight(width, dtype)
    assert torch.equal(cpu_fused.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("rows,width", SHAPES)
def test_rms_norm_float32_random_rows_within_reduction_order_rounding(rows, width, two_threads):
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(rows, width, generator=gen) * 3, _weight(width, torch.float32)
    torch.testing.assert_close(cpu_fused.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows,width", SHAPES)
def test_rms_norm_bfloat16_random_rows_at_most_one_ulp_off(rows, width, two_threads):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(rows, width, generator=gen) * 3).bfloat16()
    w = _weight(width, torch.bfloat16)
    got, ref = cpu_fused.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5)
    # only the sum-of-squares order differs: a float32 ulp of the scale can move a value
    # across a bfloat16 rounding boundary, never further
    ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs()
    assert ((got.float() - ref.float()).abs() <= ulp).all()
    assert (got == ref).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", SHAPES)
def test_add_rms_norm_adds_in_place_then_normalizes(dtype, rows, width, two_threads):
    hidden = _exact_sum_rows(rows, width, dtype, seed=3)
    delta = _exact_sum_rows(rows, width, dtype, seed=4)
    w = _weight(width, dtype)
    want_hidden = hidden + delta
    want = rms_norm(want_hidden, w, 1e-5)
    delta_before = delta.clone()
    got = cpu_fused.add_rms_norm(hidden, delta, w, 1e-5)
    assert torch.equal(hidden, want_hidden) and torch.equal(got, want)
    assert torch.equal(delta, delta_before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_add_rounds_like_torch(dtype):
    """Random (not exactly representable) sums: the in-place add rounds as torch's add."""
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(4, 97, generator=gen).to(dtype)
    delta = (torch.randn(4, 97, generator=gen) * 1e-2).to(dtype)
    want = hidden + delta
    cpu_fused.add_rms_norm(hidden, delta, _weight(97, dtype), 1e-5)
    assert torch.equal(hidden, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", [(1, 9, 3, 64), (5, 3, 1, 6),
                                                            (80, 4, 2, 16)])
def test_rope_in_place_is_bit_exact_and_leaves_v_alone(dtype, tokens, heads, kv_heads,
                                                       head_dim, two_threads):
    gen = torch.Generator().manual_seed(tokens)
    rope = RotaryEmbedding(head_dim, 10000.0, None, torch.device("cpu"))
    positions = torch.randint(0, 4000, (tokens,), generator=gen)
    cos, sin = rope.cos_sin(positions, dtype)
    qk_heads = heads + kv_heads
    qkv = torch.randn(tokens, (qk_heads + kv_heads) * head_dim, generator=gen).to(dtype)
    qk_cols = qk_heads * head_dim
    want = RotaryEmbedding.apply(qkv[:, :qk_cols].view(tokens, qk_heads, head_dim), cos, sin)
    got = qkv.clone()
    cpu_fused.rope_(got, cos, sin, qk_heads, head_dim)
    assert torch.equal(got[:, :qk_cols], want.reshape(tokens, qk_cols))
    assert torch.equal(got[:, qk_cols:], qkv[:, qk_cols:])


def test_applies_only_to_cpu_float32_and_bfloat16():
    assert cpu_fused.applies(torch.zeros(1, 4))
    assert cpu_fused.applies(torch.zeros(1, 4, dtype=torch.bfloat16))
    assert not cpu_fused.applies(torch.zeros(1, 4, dtype=torch.float16))
    assert not cpu_fused.applies(torch.zeros(1, 4, dtype=torch.float64))


def test_wrappers_refuse_strided_or_mixed_inputs():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError):
        cpu_fused.rms_norm(x[:, ::2], torch.ones(4), 1e-5)
    with pytest.raises(ValueError):
        cpu_fused.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError):
        cpu_fused.rms_norm(x.half(), torch.ones(8, dtype=torch.half), 1e-5)
    with pytest.raises(ValueError):
        cpu_fused.add_rms_norm(x, x[:2], torch.ones(8), 1e-5)
    with pytest.raises(ValueError):
        cpu_fused.rms_norm(x, torch.ones(7), 1e-5)  # would read past the weight
    with pytest.raises(ValueError):
        cpu_fused.add_rms_norm(x, x.clone(), torch.ones(9), 1e-5)
    with pytest.raises(ValueError):
        cpu_fused.rope_(x, torch.ones(4, 8), torch.ones(4, 8), 2, 8)  # 16 columns > 8


@pytest.fixture
def no_library(monkeypatch):
    """As on a machine without a C compiler (or with KVSCOPE_CPU_ATTENTION=torch)."""
    monkeypatch.setattr(cpu_native, "load_library", lambda name: None)
    cpu_fused.library.cache_clear()
    yield
    cpu_fused.library.cache_clear()


def test_no_library_means_the_torch_path(no_library):
    assert cpu_fused.library() is None and not cpu_fused.applies(torch.zeros(1, 4))


def test_the_torch_switch_turns_the_fused_kernels_off(monkeypatch):
    monkeypatch.setenv(cpu_native.ENV_BACKEND, "torch")
    cpu_fused.library.cache_clear()
    try:
        assert cpu_fused.library() is None and not cpu_fused.applies(torch.zeros(1, 4))
    finally:
        monkeypatch.delenv(cpu_native.ENV_BACKEND)
        cpu_fused.library.cache_clear()
    assert cpu_fused.applies(torch.zeros(1, 4))


def _tiny_model(dtype: torch.dtype):
    from kvscope.engine.model.dummy import load_dummy

    model = load_dummy("dummy:tiny", "cpu", dtype, seed=0)[0]
    gen = torch.Generator().manual_seed(7)
    for norm in [n for layer in model.layers for n in (layer.input_norm, layer.post_norm)] + [
            model.final_norm]:  # dummy norms are ones: give them something to multiply
        norm.copy_(1 + 0.2 * torch.randn(norm.shape, generator=gen))
    return model


def _forward(model, ids: list[int]) -> torch.Tensor:
    from kvscope.engine.model.contiguous_cache import ContiguousKVCache

    cache = ContiguousKVCache(model.config, len(ids), model.device, model.dtype)
    return model.forward(torch.tensor(ids), torch.arange(len(ids)), cache)


@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_with_and_without_the_fused_kernels(dtype, monkeypatch):
    """The whole forward (prefill of 37 tokens: T > 1) with the kernels and on the torch path
    (the kernels patched away): the same hidden states up to the RMSNorm sum order."""
    model = _tiny_model(dtype)
    ids = [(i * 37) % 500 + 3 for i in range(37)]
    native = _forward(model, ids)
    monkeypatch.setattr(cpu_fused, "applies", lambda x: False)
    reference = _forward(model, ids)
    if dtype == torch.float32:
        torch.testing.assert_close(native, reference, rtol=1e-5, atol=1e-5)
    else:  # a one-ulp RMSNorm difference can propagate through the layers
        torch.testing.assert_close(native.float(), reference.float(), rtol=0.02, atol=0.02)
        assert (native == reference).float().mean() > 0.9
