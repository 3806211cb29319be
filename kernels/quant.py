"""Quantized KV page formats: what a page holds, and the torch quantize/dequantize math.

The format of a cache follows from its dtype (so the positional kernel APIs never change):

- ``auto``: fp32 / fp16 / bf16 pages, no scales.
- ``fp8``: ``float8_e4m3fn`` pages; one fp32 scale per KV head of a layer (``[Hkv]``; a 0-d
  or ``[1]`` tensor is a per-tensor scale), calibrated or given by the caller, constant
  for the cache's life, so it never travels with a block. code = clamp(x / scale, +-448).
- ``int8``: ``int8`` pages, symmetric: one scale per token per KV head, written with the
  token into ``scales [num_blocks, block_size, Hkv, 1]`` (fp16). code = round(x / scale)
  in [-127, 127], scale = amax / 127 rounded *up* to fp16, so |x - deq| <= scale / 2.
- ``int4``: ``uint8`` pages of ``head_dim / 2`` bytes, two codes per byte (element 2i in
  the low nibble of byte i, 2i+1 in the high one); asymmetric: ``scales [..., Hkv, 2]``
  (fp16) holds (scale, zero) per token per KV head. zero = min rounded *down* to fp16,
  scale = (max - zero) / 15 rounded up, code = round((x - zero) / scale) in [0, 15],
  deq = code * scale + zero, so |x - deq| <= scale / 2.

Why fp16 scales: at head_dim 64 (SmolLM2) an fp32 scale costs 4 of 68 bytes per token-head
and int8 pages come out 1.88x smaller than fp16, an fp16 one 1.94x; int4 with an fp16
(scale, zero) pair is 3.56x, with fp32 3.2x. The directed rounding (scale up, zero down)
keeps the error bound of half a step exact despite the fp16 rounding. Rounding is
floor(v + 0.5) everywhere (torch and Triton) so both backends produce the same codes.
Keys and values use the same format: keys never get fewer bits than values.
"""

from __future__ import annotations

import torch

FORMATS = ("auto", "fp8", "int8", "int4")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_DTYPE = torch.float16
INT8_MAX = 127
INT4_LEVELS = 15
# fp16 limits for the per-token scales: the smallest normal (a step no smaller than this
# keeps the round-up margin below valid) and the largest finite value.
SCALE_MIN = 2.0 ** -14
SCALE_MAX = 65504.0
# Multiplying by (1 + 2^-10) before rounding to fp16 (relative error <= 2^-11) rounds up.
_UP = 1.0 + 2.0 ** -10
_DOWN = 2.0 ** -10

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DTYPE_FORMAT = {FP8_DTYPE: "fp8", torch.int8: "int8", torch.uint8: "int4"}
CACHE_DTYPES = (*_FLOAT_DTYPES, *_DTYPE_FORMAT)


def format_of(cache: torch.Tensor) -> str:
    """The page format a cache tensor stores, from its dtype."""
    if cache.dtype in _FLOAT_DTYPES:
        return "auto"
    if cache.dtype in _DTYPE_FORMAT:
        return _DTYPE_FORMAT[cache.dtype]
    raise ValueError(f"cache dtype {cache.dtype} is not a page format; use one of "
                     f"{[str(d) for d in CACHE_DTYPES]}")


def cache_dtype(fmt: str, model_dtype: torch.dtype) -> torch.dtype:
    """The page dtype of a format (``auto``: the model's dtype)."""
    if fmt == "auto":
        return model_dtype
    return {"fp8": FP8_DTYPE, "int8": torch.int8, "int4": torch.uint8}[_known(fmt)]


def packed_dim(fmt: str, head_dim: int) -> int:
    """The page's last dimension: head_dim elements, or head_dim / 2 bytes for int4."""
    if _known(fmt) == "int4":
        if head_dim % 2:
            raise ValueError(f"int4 pages pack two values per byte: head_dim {head_dim} "
                             "must be even")
        return head_dim // 2
    return head_dim


def head_dim_of(cache: torch.Tensor) -> int:
    """The logical head_dim of a page tensor (int4 pages hold two values per byte)."""
    return cache.shape[-1] * (2 if cache.dtype == torch.uint8 else 1)


def scale_params(fmt: str) -> int:
    """Per-token scale values per KV head that travel with the block (0: none)."""
    return {"auto": 0, "fp8": 0, "int8": 1, "int4": 2}[_known(fmt)]


def _known(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown KV page format {fmt!r}; choose one of {FORMATS}")
    return fmt


# ----------------------------------------------------------------------------- quantize
def _round(v: torch.Tensor) -> torch.Tensor:
    return torch.floor(v + 0.5)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes int8 [..., D], scales fp16 [..., 1]), one scale per vector."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = (amax * (_UP / INT8_MAX)).clamp_(SCALE_MIN, SCALE_MAX).to(SCALE_DTYPE)
    codes = _round(x / scale.float()).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (D even) -> (packed uint8 [..., D/2], fp16 [..., 2] = (scale, zero))."""
    x = x.float()
    lo = x.amin(-1, keepdim=True)
    hi = x.amax(-1, keepdim=True)
    zero = (lo - lo.abs() * _DOWN).clamp_(-SCALE_MAX, SCALE_MAX).to(SCALE_DTYPE)
    scale = ((hi - zero.float()) * (_UP / INT4_LEVELS)).clamp_(SCALE_MIN, SCALE_MAX)
    scale = scale.to(SCALE_DTYPE)
    codes = _round((x - zero.float()) / scale.float()).clamp_(0, INT4_LEVELS).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, torch.cat([scale, zero], dim=-1)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., Hkv, D] with a per-head scale [Hkv] (or one scalar) -> fp8 e4m3 codes."""
    s = fp8_scale_view(scale, x.shape[-2], x.device)
    return (x.float() / s[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def fp8_scale_view(scale: torch.Tensor | None, num_kv_heads: int,
                   device: torch.device) -> torch.Tensor:
    """A per-head fp32 scale vector [Hkv] from None (1.0), a scalar or [1] or [Hkv]."""
    if scale is None:
        return torch.ones(num_kv_heads, dtype=torch.float32, device=device)
    return scale.float().reshape(-1).expand(num_kv_heads)


def fp8_scale_from(x: torch.Tensor, headroom: float = 2.0) -> torch.Tensor:
    """Calibrate a per-head fp8 scale from sample vectors x [T, Hkv, D]: amax * headroom
    maps to 448. e4m3 is floating point (relative step 2^-4 at any magnitude down to
    2^-6 * scale), so headroom for later, larger tokens costs almost no precision."""
    amax = x.float().abs().amax(dim=(0, 2))
    return (amax * (headroom / FP8_MAX)).clamp_(min=1e-8)


def quantize(x: torch.Tensor, fmt: str,
             fp8_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, Hkv, D] -> (codes, per-token scales or None) in the layout of ``fmt``'s pages."""
    if fmt == "int8":
        return quantize_int8(x)
    if fmt == "int4":
        return quantize_int4(x)
    if fmt == "fp8":
        return quantize_fp8(x, fp8_scale), None
    raise ValueError(f"format {fmt!r} does not quantize")


def dequantize(codes: torch.Tensor, scales: torch.Tensor | None, fmt: str,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Pages or gathered pages ``codes [..., Hkv, Dp]`` back to values ``[..., Hkv, D]``.

    ``scales``: per-token ``[..., Hkv, P]`` for int8/int4, the per-head fp8 scale for fp8
    (None: 1.0), ignored for auto.
    """
    if fmt == "auto":
        return codes.to(dtype)
    if fmt == "fp8":
        s = fp8_scale_view(scales, codes.shape[-2], codes.device)
        return (_lookup(codes.view(torch.uint8), "fp8") * s[:, None]).to(dtype)
    if fmt == "int8":
        return (codes.float() * scales.float()).to(dtype)
    if fmt == "int4":
        values = _lookup(codes, "int4").flatten(-2)  # [..., D/2, 2] -> [..., D]
        s = scales.float()
        return torch.addcmul(s[..., 1:2], values, s[..., 0:1]).to(dtype)
    raise ValueError(f"unknown KV page format {fmt!r}")


_LUTS: dict[tuple[str, torch.device], torch.Tensor] = {}


def _lookup(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """Decode bytes through a 256-entry fp32 table: fp8 byte -> value, int4 byte -> its
    (low, high) nibbles as [..., 2]. One index_select instead of torch's elementwise
    float8 cast or an unpack + stack, measured 2-7x faster on CPU."""
    key = (fmt, codes.device)
    lut = _LUTS.get(key)
    if lut is None:
        every = torch.arange(256, dtype=torch.int64)
        if fmt == "fp8":
            lut = every.to(torch.uint8).view(FP8_DTYPE).float()
        else:
            lut = torch.stack([every & 15, every >> 4], dim=-1).float()
        lut = _LUTS[key] = lut.to(codes.device)
    flat = lut.index_select(0, codes.reshape(-1).int())
    return flat.view(*codes.shape, *lut.shape[1:])


def step(scales: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """The quantization step per token-head (int8/int4: the stored scale [..., Hkv, 1])."""
    if fmt in ("int8", "int4"):
        return scales[..., 0:1].float()
    raise ValueError(f"format {fmt!r} has no per-token step")


def hadamard(n: int, dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal Sylvester-Hadamard matrix of order n (a power of two): H @ H.T = I.

    Rotating keys and values by it before quantization (QuaRot) spreads a few outlier
    channels over all of them, so a per-token scale fits the bulk of the values far better;
    q is rotated the same way and attention's output rotated back, which leaves attention
    exactly unchanged: (qH)(kH)^T = qk^T and P(vH)H^T = Pv.
    """
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester-Hadamard matrix needs a power-of-two order, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n ** 0.5).to(dtype=dtype, device=device)
