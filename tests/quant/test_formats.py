"""kvscope.kernels.quant: quantize -> dequantize stays within each format's step; layouts."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels import quant


def _vectors(seed: int = 0) -> torch.Tensor:
    """[T, Hkv, D] with a wide spread of magnitudes, outlier channels and edge rows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 3, 64, generator=gen)
    x *= torch.logspace(-3, 2, 64)[:, None, None]  # 1e-3 .. 100 per token
    x[:, :, 5] *= 10.0  # outlier channel
    x[0] = 0.0  # all-zero token
    x[1] = 3.25  # constant token
    x[2, :, :] = -1e-6  # tiny, below fp16's normal range
    return x


def test_int8_error_within_half_a_step_and_scale_not_wasteful():
    x = _vectors()
    codes, scales = quant.quantize_int8(x)
    assert codes.dtype == torch.int8 and scales.shape == (64, 3, 1)
    assert scales.dtype == quant.SCALE_DTYPE
    step = quant.step(scales, "int8")
    err = (quant.dequantize(codes, scales, "int8") - x).abs()
    assert bool((err <= step / 2 + 1e-7).all())
    amax = x.abs().amax(-1, keepdim=True)
    # rounded up, but by no more than fp16's rounding plus the 2^-10 margin
    assert bool((step >= amax / 127).all())
    assert bool((step <= torch.maximum(amax / 127 * 1.0025, torch.tensor(quant.SCALE_MIN))).all())
    assert int(codes.abs().max()) <= 127


def test_int4_error_within_half_a_step_and_packing_layout():
    x = _vectors(1)
    packed, params = quant.quantize_int4(x)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 3, 32)
    assert params.shape == (64, 3, 2) and params.dtype == quant.SCALE_DTYPE
    step = quant.step(params, "int4")
    err = (quant.dequantize(packed, params, "int4") - x).abs()
    assert bool((err <= step / 2 + 1e-6).all())
    # element 2i in the low nibble of byte i, 2i+1 in the high nibble
    zero, scale = params[..., 1:2].float(), params[..., 0:1].float()
    codes = torch.floor((x - zero) / scale + 0.5).clamp(0, 15).to(torch.uint8)
    assert torch.equal(packed & 15, codes[..., 0::2])
    assert torch.equal(packed >> 4, codes[..., 1::2])
    # range covered: the largest value is reachable with code 15
    hi = x.amax(-1, keepdim=True)
    assert bool((zero + 15 * scale >= hi - 1e-6).all())


def test_fp8_error_within_the_e4m3_step_and_saturation():
    x = _vectors(2)
    scale = torch.tensor([0.5, 1.0, 4.0])
    codes = quant.quantize_fp8(x, scale)
    assert codes.dtype == quant.FP8_DTYPE
    deq = quant.dequantize(codes, scale, "fp8")
    s = scale[:, None]
    in_range = x.abs() <= 448 * s
    # 3 mantissa bits: half an ulp is 2^-4 relative; subnormals: half of 2^-9 absolute
    bound = x.abs() * 2.0 ** -4 + 2.0 ** -10 * s
    assert bool(((deq - x).abs() <= bound)[in_range].all())
    # out of range saturates at +-448 * scale instead of becoming NaN
    assert bool((~in_range).any())
    assert torch.equal(deq[~in_range], (448 * s.expand_as(x) * x.sign())[~in_range])


def test_fp8_calibrated_scale_fits_the_sample_with_headroom():
    x = _vectors(3)
    scale = quant.fp8_scale_from(x, headroom=2.0)
    assert scale.shape == (3,)
    assert bool((x.abs().amax(dim=(0, 2)) * 2.0 / 448 <= scale * 1.0001).all())
    assert not quant.quantize_fp8(x, scale).float().isnan().any()


def test_formats_describe_their_pages():
    assert quant.cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert [quant.cache_dtype(f, torch.float32) for f in ("fp8", "int8", "int4")] == [
        torch.float8_e4m3fn, torch.int8, torch.uint8]
    assert [quant.scale_params(f) for f in quant.FORMATS] == [0, 0, 1, 2]
    assert quant.packed_dim("int4", 64) == 32 and quant.packed_dim("int8", 64) == 64
    with pytest.raises(ValueError, match="even"):
        quant.packed_dim("int4", 63)
    with pytest.raises(ValueError, match="unknown KV page format"):
        quant.scale_params("int3")
    with pytest.raises(ValueError, match="not a page format"):
        quant.format_of(torch.zeros(1, dtype=torch.int16))


def test_hadamard_is_orthonormal_and_rejects_other_orders():
    h = quant.hadamard(64)
    torch.testing.assert_close(h @ h.T, torch.eye(64), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="power-of-two"):
        quant.hadamard(48)
