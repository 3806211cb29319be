"""Block-quantized KV pages (KIVI): keys per channel over a block's tokens, values per token,
and a full-precision residual window for the block still being filled.

Why per channel: a few key channels carry outliers (SmolLM2: |k| ~16-20 against a median
~1), so one scale per token is set by them and the bulk of the channels gets a coarse
step; one scale per channel over a group of tokens follows each channel's own range.
Values have no such channels and stay per token. A per-channel scale needs the group's
tokens first, so the tokens of a block that is not yet full are kept at full precision
(the residual window, at most one block per sequence) and the block is quantized in one
go when its last token arrives (``quantize_block``); attention reads complete blocks from
their codes and the residual block as it is.

Formats (``FORMATS``), every code asymmetric with a 2-byte (scale, zero) pair per group:

- ``kivi4``: 4-bit keys per channel over the block, 4-bit values per token.
- ``k8v4``: 8-bit keys per token, 4-bit values per token.
- ``kivi2``: 2-bit keys per channel over the block, 2-bit values per token.

Codes are packed along head_dim, ``8 / bits`` per byte, element ``i`` of a group of
``8 / bits`` in bits ``[bits * i, bits * (i + 1))`` (for 4 bits: element 2j in the low
nibble of byte j, as ``kernels.quant``'s int4). Page tensors per layer:

- K codes ``[num_blocks, block_size, Hkv, D * kbits / 8]`` uint8; K scales uint8
  ``[num_blocks, Hkv, D, 2]`` (per channel, 8-bit codes), ``[num_blocks, Hkv, D / 2, 3]``
  (per channel, 6-bit codes: two channels' pairs in 24 bits) or
  ``[num_blocks, block_size, Hkv, 2]`` (per token): ``key_scale_shape``; K supers
  ``[num_blocks, Hkv, 2]`` fp16;
- V codes ``[num_blocks, block_size, Hkv, D * vbits / 8]`` uint8, V scales
  ``[num_blocks, block_size, Hkv, 2]`` uint8, V supers ``[num_blocks, Hkv, 2]`` fp16.

Why 8-bit scales: fp16 (scale, zero) per channel per 16-token block cost 16 bytes a token
at head 64, half of a 4-bit key's codes. A group's pair is (c, z): scale = smax *
2^(-c / 16) (log-coded: a channel 20x smaller than the outlier channel keeps a step within
4.4% of its own), zero = (z - 128) * zstep, with (smax, zstep) fp16 per (block, head).
Rounding (``quantize_groups``) keeps |x - deq| <= scale / 2 for every element.

Why kivi4's key pairs have 6-bit codes (12 bits a pair): at block 16 its 8-bit per-channel
pairs cost 8 of its 74.5 bytes per token-head (K and V), which left it at 3.44x fp16; with
6-bit codes (scale = smax * 2^(-c / 8), 9% apart over 8 octaves; zero = (z - 32) * zstep,
|z - 32| <= 31) they cost 6, for 3.53x. A channel below smax / 256 gets the coarsest
scale, still >= its need, so the half-step bound holds. Bits laid out per pair of
channels (2j, 2j + 1), little-endian over 3 bytes: c_2j in bits 0-5, z_2j in 6-11,
c_2j+1 in 12-17, z_2j+1 in 18-23.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.kernels import quant


@dataclass(frozen=True)
class BlockFormat:
    """One block-quantized page format. ``rotate_keys``/``rotate_values``: whether K/V are
    stored in the Hadamard basis (``kernels.quant.hadamard``; q and the output follow)."""

    name: str
    key_bits: int
    value_bits: int
    keys_per_channel: bool
    rotate_keys: bool
    rotate_values: bool = True
    key_pair_bits: int = 8  # bits of each code of a per-channel key pair: 8 or 6

    def __post_init__(self) -> None:
        for bits in (self.key_bits, self.value_bits):
            if bits not in (2, 4, 8):
                raise ValueError(f"{self.name}: codes of {bits} bits; use 2, 4 or 8")
        if self.key_pair_bits not in (6, 8) or (
                self.key_pair_bits != 8 and not self.keys_per_channel):
            raise ValueError(f"{self.name}: key pair codes of {self.key_pair_bits} bits; use 8, "
                             "or 6 with per-channel keys")

    def packed_dim(self, bits: int, head_dim: int) -> int:
        per = 8 // bits
        if head_dim % per:
            raise ValueError(f"{self.name}: {bits}-bit codes pack {per} per byte, head_dim "
                             f"{head_dim} is not a multiple")
        return head_dim // per

    def bytes_per_token_head(self, head_dim: int, block_size: int) -> float:
        """K and V of one token-head, averaged: codes plus the scales amortised over the
        block (per-channel keys: 2 bytes per channel per block; per token: 2 bytes) and the
        4-byte super pair of each (block, head), for K and for V."""
        k = self.packed_dim(self.key_bits, head_dim)
        k += self.key_pair_bits / 4 * head_dim / block_size if self.keys_per_channel else 2
        v = self.packed_dim(self.value_bits, head_dim) + 2
        return (k + v + 2 * 4 / block_size) / 2


# Measured choices (docs/benchmarks/quant.md, 1,024 tokens of prose and of code): rotating
# per-channel keys still lowered mean KL on both texts (kivi4 0.00176 -> 0.00147 prose,
# 0.00231 -> 0.00202 code; kivi2 0.0651 -> 0.0649, 0.0856 -> 0.0735); unrotated values
# raised it (kivi4 0.00176 -> 0.00214). Per-channel 8-bit keys gained nothing over per-token
# ones (k8v4: KL 0.00052 vs 0.00051), so k8v4 keeps per-token keys (no per-channel scales).
# kivi4's key pairs have 6-bit codes (module docstring): its capacity goal, 3.5x.
FORMATS = {
    "kivi4": BlockFormat("kivi4", 4, 4, keys_per_channel=True, rotate_keys=True,
                         key_pair_bits=6),
    "k8v4": BlockFormat("k8v4", 8, 4, keys_per_channel=False, rotate_keys=True),
    "kivi2": BlockFormat("kivi2", 2, 2, keys_per_channel=True, rotate_keys=True),
}


def block_format(name: str) -> BlockFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown block-quantized format {name!r}; one of {tuple(FORMATS)}")
    return FORMATS[name]


# ----------------------------------------------------------------------------- codes
SUPER_DTYPE = quant.SCALE_DTYPE
# Pair codes of ``bits`` bits -> (log steps per octave, largest |zero code|): an 8-bit scale
# code c means smax * 2^(-c / 16) (4.4% apart, 16 octaves), an 8-bit zero code z means
# (z - 128) * zstep, |z - 128| <= 127; 6-bit: 2^(-c / 8) (9% apart, 8 octaves), (z - 32).
PAIR_CODES = {8: (16, 127), 6: (8, 31)}
_TABLES = {bits: torch.exp2(-torch.arange(1 << bits, dtype=torch.float32) / steps)
           for bits, (steps, _) in PAIR_CODES.items()}


def scale_table(pair_bits: int = 8) -> torch.Tensor:
    """The float32 factors ``2^(-c / steps)`` of ``pair_bits``-bit scale codes (C kernels
    read it)."""
    return _TABLES[pair_bits]


def zero_offset(pair_bits: int = 8) -> int:
    """What a zero code is stored above: 128 for 8-bit codes, 32 for 6-bit ones."""
    return 1 << (pair_bits - 1)


def key_scale_shape(fmt: BlockFormat, num_blocks: int, block_size: int, num_kv_heads: int,
                    head_dim: int) -> tuple[int, ...]:
    """The shape of a layer's K scale pairs (uint8; module docstring)."""
    if not fmt.keys_per_channel:
        return (num_blocks, block_size, num_kv_heads, 2)
    if fmt.key_pair_bits == 6:
        return (num_blocks, num_kv_heads, head_dim // 2, 3)
    return (num_blocks, num_kv_heads, head_dim, 2)


def pack_pairs6(pairs: torch.Tensor) -> torch.Tensor:
    """6-bit pairs ``[..., D, 2]`` (each code < 64) -> ``[..., D / 2, 3]`` bytes."""
    p = pairs.to(torch.int32).reshape(*pairs.shape[:-2], -1, 4)
    v = p[..., 0] | p[..., 1] << 6 | p[..., 2] << 12 | p[..., 3] << 18
    return torch.stack([v & 255, (v >> 8) & 255, v >> 16], dim=-1).to(torch.uint8)


def unpack_pairs6(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_pairs6``: ``[..., D / 2, 3]`` -> ``[..., D, 2]`` uint8."""
    b = packed.to(torch.int32)
    v = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16
    codes = torch.stack([(v >> shift) & 63 for shift in (0, 6, 12, 18)], dim=-1)
    return codes.reshape(*packed.shape[:-2], -1, 2).to(torch.uint8)


def _round_up_fp16(x: torch.Tensor) -> torch.Tensor:
    return (x * quant._UP).clamp_(quant.SCALE_MIN, quant.SCALE_MAX).to(SUPER_DTYPE)


def quantize_groups(x: torch.Tensor, bits: int, dim: int, pair_bits: int = 8
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks ``x [n, T, Hkv, C]`` -> (codes uint8 unpacked, scales uint8, super fp16), one
    group per slice along ``dim`` (1: per channel over the block's tokens, -1: per token).

    Every group's (scale, zero) is a pair of ``pair_bits``-bit codes (``PAIR_CODES``): a
    log-coded scale and a linear zero, both relative to its (block, head)'s fp16 super pair
    ``[n, Hkv, 2]`` = (smax, zstep). Rounding keeps the half-step bound: zstep = max |min| /
    Z (Z = 127 for 8-bit codes) and smax = the largest need (below), both rounded up to
    fp16; z = the largest integer with z * zstep <= the group's min; need = (max - zero) /
    levels; c = the largest code in [0, 2^pair_bits) with smax * table[c] >= need; code =
    floor((x - zero) / scale + 0.5) clamped to [0, levels].
    ``scales [..., 2]`` = (c, z + zero_offset) in the group's position (size 1 along
    ``dim``)."""
    levels = (1 << bits) - 1
    steps, zero_codes = PAIR_CODES[pair_bits]
    table, top = _TABLES[pair_bits], (1 << pair_bits) - 1
    x = x.float()
    lo = x.amin(dim, keepdim=True)
    hi = x.amax(dim, keepdim=True)
    family = (1, 3)  # every group of a (block, head)
    zstep = _round_up_fp16(lo.abs().amax(family, keepdim=True) / zero_codes)
    zs = zstep.float()
    zc = torch.floor(lo / zs).clamp_(-zero_codes, zero_codes)
    zc -= (zc * zs > lo).float()  # float rounding: keep zero <= min
    zero = zc * zs
    need = (hi - zero) / levels
    smax = _round_up_fp16(need.amax(family, keepdim=True))
    sm = smax.float()
    ratio = (need / sm).clamp_(min=2.0 ** -20)
    sc = torch.floor(-steps * torch.log2(ratio)).clamp_(0, top)
    # c is the largest code whose scale is still >= need (log2's rounding may miss by one)
    sc -= (table[sc.long()] * sm < need).float()
    up = (sc + 1).clamp_(max=top)
    sc += ((sc < top) & (table[up.long()] * sm >= need)).float()
    scale = table[sc.long()] * sm
    codes = torch.floor((x - zero) / scale + 0.5).clamp_(0, levels)
    scales = torch.stack([sc, zc + zero_offset(pair_bits)], dim=-1).to(torch.uint8)
    supers = torch.stack([smax[:, 0, :, 0], zstep[:, 0, :, 0]], dim=-1)
    return codes.to(torch.uint8), scales, supers


def expand_scales(scales: torch.Tensor, supers: torch.Tensor, pair_bits: int = 8
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales uint8 ``[n, T, Hkv, C, 2]``, supers ``[n, Hkv, 2]``) -> float32 (scale, zero)
    ``[n, T, Hkv, C]`` each."""
    s = supers.float()[:, None, :, None, :]
    scale = _TABLES[pair_bits].to(scales.device)[scales[..., 0].long()] * s[..., 0]
    zero = (scales[..., 1].float() - zero_offset(pair_bits)) * s[..., 1]
    return scale, zero


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unpacked codes [..., D] (each < 2^bits) -> bytes [..., D * bits / 8]."""
    per = 8 // bits
    if per == 1:
        return codes
    grouped = codes.view(*codes.shape[:-1], -1, per)
    out = grouped[..., 0].clone()
    for i in range(1, per):
        out |= grouped[..., i] << (bits * i)
    return out


_LUTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Bytes [..., Dp] -> code values [..., Dp * 8 / bits] as float32 (one 256-entry table
    lookup, as ``kernels.quant._lookup``)."""
    per = 8 // bits
    key = (bits, packed.device)
    lut = _LUTS.get(key)
    if lut is None:
        every = torch.arange(256, dtype=torch.int64)
        mask = (1 << bits) - 1
        lut = torch.stack([(every >> (bits * i)) & mask for i in range(per)], dim=-1)
        lut = _LUTS[key] = lut.float().to(packed.device)
    flat = lut.index_select(0, packed.reshape(-1).int())
    return flat.view(*packed.shape[:-1], packed.shape[-1] * per)


Quantized = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # (packed codes, scales, supers)


def quantize_keys(x: torch.Tensor, fmt: BlockFormat) -> Quantized:
    """Complete blocks ``x [n, block_size, Hkv, D]`` -> (packed codes, scales uint8, supers
    ``[n, Hkv, 2]`` fp16): scales per channel over the block's tokens (``[n, Hkv, D, 2]``, or
    6-bit pairs packed ``[n, Hkv, D / 2, 3]``), or per token ``[n, block_size, Hkv, 2]``."""
    if fmt.keys_per_channel:
        codes, scales, supers = quantize_groups(x, fmt.key_bits, 1, fmt.key_pair_bits)
        pairs = scales[:, 0] if fmt.key_pair_bits == 8 else pack_pairs6(scales[:, 0])
        return pack(codes, fmt.key_bits), pairs, supers
    codes, scales, supers = quantize_groups(x, fmt.key_bits, dim=-1)
    return pack(codes, fmt.key_bits), scales[..., 0, :], supers


def quantize_values(x: torch.Tensor, fmt: BlockFormat) -> Quantized:
    """Complete blocks ``x [n, block_size, Hkv, D]`` -> (packed codes, scales
    ``[n, block_size, Hkv, 2]`` uint8, supers ``[n, Hkv, 2]``), per token."""
    codes, scales, supers = quantize_groups(x, fmt.value_bits, dim=-1)
    return pack(codes, fmt.value_bits), scales[..., 0, :], supers


def _scale_zero(scales: torch.Tensor, supers: torch.Tensor, per_channel: bool,
                pair_bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Float (scale, zero) broadcastable over ``[n, block_size, Hkv, D]``."""
    if per_channel:  # [n, Hkv, D, 2] -> [n, 1, Hkv, D]
        if pair_bits == 6:
            scales = unpack_pairs6(scales)
        return expand_scales(scales[:, None], supers, pair_bits)
    return expand_scales(scales[..., None, :], supers)  # [n, T, Hkv, 1]


def dequantize_keys(codes: torch.Tensor, scales: torch.Tensor, supers: torch.Tensor,
                    fmt: BlockFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize_keys`` for blocks ``[n, block_size, Hkv, Dp]``."""
    scale, zero = _scale_zero(scales, supers, fmt.keys_per_channel, fmt.key_pair_bits)
    return torch.addcmul(zero, unpack(codes, fmt.key_bits), scale).to(dtype)


def dequantize_values(codes: torch.Tensor, scales: torch.Tensor, supers: torch.Tensor,
                      fmt: BlockFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    scale, zero = _scale_zero(scales, supers, False)
    return torch.addcmul(zero, unpack(codes, fmt.value_bits), scale).to(dtype)


def key_step(scales: torch.Tensor, supers: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The quantization step of every key element's group (broadcast over the block)."""
    return _scale_zero(scales, supers, fmt.keys_per_channel, fmt.key_pair_bits)[0]


def value_step(scales: torch.Tensor, supers: torch.Tensor) -> torch.Tensor:
    return _scale_zero(scales, supers, False)[0]


# ----------------------------------------------------------------------------- pages
@dataclass
class BlockLayer:
    """One layer's block-quantized pages and its residual window.

    ``residual_k``/``residual_v [R, block_size, Hkv, D]`` (the model dtype) hold the tokens
    of blocks not yet complete; ``slot_of [num_blocks]`` int64 names a block's residual row
    (-1: the block is read from its codes). The slot map is shared by every layer
    (``engine.runner.block_kv`` owns it); each layer has its own residual rows."""

    fmt: BlockFormat
    k_codes: torch.Tensor
    k_scales: torch.Tensor
    k_supers: torch.Tensor
    v_codes: torch.Tensor
    v_scales: torch.Tensor
    v_supers: torch.Tensor
    residual_k: torch.Tensor
    residual_v: torch.Tensor
    slot_of: torch.Tensor

    @property
    def num_blocks(self) -> int:
        return self.k_codes.shape[0]

    @property
    def block_size(self) -> int:
        return self.k_codes.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.k_codes.shape[2]

    def compute_dtype(self, q: torch.Tensor) -> torch.dtype:
        return q.dtype

    @property
    def k_scale(self) -> torch.Tensor:
        """Not None: ``kernels.cpu_attention``'s native float kernels skip these pages."""
        return self.k_scales

    def gather(self, pages: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pages ``[n]`` -> K, V ``[n, block_size, Hkv, D]``: complete blocks dequantized,
        blocks in the residual window read from it (``kernels.reference.attend_pages``'s
        page-store interface)."""
        fmt = self.fmt
        k = dequantize_keys(self.k_codes.index_select(0, pages),
                            self.k_scales.index_select(0, pages),
                            self.k_supers.index_select(0, pages), fmt, dtype)
        v = dequantize_values(self.v_codes.index_select(0, pages),
                              self.v_scales.index_select(0, pages),
                              self.v_supers.index_select(0, pages), fmt, dtype)
        slots = self.slot_of.index_select(0, pages)
        live = (slots >= 0).nonzero().flatten()
        if live.numel():
            rows = slots.index_select(0, live)
            k.index_copy_(0, live, self.residual_k.index_select(0, rows).to(dtype))
            v.index_copy_(0, live, self.residual_v.index_select(0, rows).to(dtype))
        return k, v

    def seal(self, blocks: torch.Tensor, rows: torch.Tensor) -> None:
        """Quantize complete blocks ``blocks [m]`` from their residual rows ``rows [m]``
        in one go (the caller then frees the rows and clears ``slot_of``)."""
        if not blocks.numel():
            return
        k = self.residual_k.index_select(0, rows)
        v = self.residual_v.index_select(0, rows)
        for q, dst in ((quantize_keys(k, self.fmt), self.key_tensors),
                       (quantize_values(v, self.fmt), self.value_tensors)):
            for src, t in zip(q, dst, strict=True):
                t.index_copy_(0, blocks, src)

    @property
    def key_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.k_codes, self.k_scales, self.k_supers

    @property
    def value_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.v_codes, self.v_scales, self.v_supers
