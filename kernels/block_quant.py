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

Formats (``FORMATS``), every code asymmetric with an fp16 (scale, zero) pair:

- ``kivi4``: 4-bit keys per channel over the block, 4-bit values per token.
- ``k8v4``: 8-bit keys per token, 4-bit values per token.
- ``kivi2``: 2-bit keys per channel over the block, 2-bit values per token.

Codes are packed along head_dim, ``8 / bits`` per byte, element ``i`` of a group of
``8 / bits`` in bits ``[bits * i, bits * (i + 1))`` (for 4 bits: element 2j in the low
nibble of byte j, as ``kernels.quant``'s int4). Page tensors per layer:

- K codes ``[num_blocks, block_size, Hkv, D * kbits / 8]`` uint8; K scales
  ``[num_blocks, Hkv, D, 2]`` fp16 (per channel) or ``[num_blocks, block_size, Hkv, 2]``
  (per token);
- V codes ``[num_blocks, block_size, Hkv, D * vbits / 8]`` uint8, V scales
  ``[num_blocks, block_size, Hkv, 2]`` fp16.

Rounding as ``kernels.quant``: zero = min rounded down to fp16, scale = (max - zero) /
levels rounded up, code = floor((x - zero) / scale + 0.5) clamped to [0, levels], so
|x - deq| <= scale / 2 for every element.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import quant


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

    def __post_init__(self) -> None:
        for bits in (self.key_bits, self.value_bits):
            if bits not in (2, 4, 8):
                raise ValueError(f"{self.name}: codes of {bits} bits; use 2, 4 or 8")

    def packed_dim(self, bits: int, head_dim: int) -> int:
        per = 8 // bits
        if head_dim % per:
            raise ValueError(f"{self.name}: {bits}-bit codes pack {per} per byte, head_dim "
                             f"{head_dim} is not a multiple")
        return head_dim // per

    def bytes_per_token_head(self, head_dim: int, block_size: int) -> float:
        """K and V of one token-head, averaged: codes plus the scales amortised over the
        block (per-channel keys: 2 fp16 per channel per block)."""
        k = self.packed_dim(self.key_bits, head_dim)
        k += 4 * head_dim / block_size if self.keys_per_channel else 4
        v = self.packed_dim(self.value_bits, head_dim) + 4
        return (k + v) / 2


# Measured choices (docs/benchmarks/quant.md, 1,024 tokens of prose and of code): rotating
# per-channel keys still lowered mean KL on both texts (kivi4 0.00176 -> 0.00147 prose,
# 0.00231 -> 0.00202 code; kivi2 0.0651 -> 0.0649, 0.0856 -> 0.0735); unrotated values
# raised it (kivi4 0.00176 -> 0.00214). Per-channel 8-bit keys gained nothing over per-token
# ones (k8v4: KL 0.00052 vs 0.00051), so k8v4 keeps per-token keys (no per-channel scales).
FORMATS = {
    "kivi4": BlockFormat("kivi4", 4, 4, keys_per_channel=True, rotate_keys=True),
    "k8v4": BlockFormat("k8v4", 8, 4, keys_per_channel=False, rotate_keys=True),
    "kivi2": BlockFormat("kivi2", 2, 2, keys_per_channel=True, rotate_keys=True),
}


def block_format(name: str) -> BlockFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown block-quantized format {name!r}; one of {tuple(FORMATS)}")
    return FORMATS[name]


# ----------------------------------------------------------------------------- codes
def quantize_asym(x: torch.Tensor, bits: int, dim: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x -> (codes uint8 unpacked, scale fp16, zero fp16), one (scale, zero) per slice
    along ``dim`` (kept as a size-1 dim)."""
    levels = (1 << bits) - 1
    x = x.float()
    lo = x.amin(dim, keepdim=True)
    hi = x.amax(dim, keepdim=True)
    zero = (lo - lo.abs() * quant._DOWN).clamp_(-quant.SCALE_MAX, quant.SCALE_MAX)
    zero = zero.to(quant.SCALE_DTYPE)
    scale = ((hi - zero.float()) * (quant._UP / levels)).clamp_(quant.SCALE_MIN,
                                                                quant.SCALE_MAX)
    scale = scale.to(quant.SCALE_DTYPE)
    codes = torch.floor((x - zero.float()) / scale.float() + 0.5).clamp_(0, levels)
    return codes.to(torch.uint8), scale, zero


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


def quantize_keys(x: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Complete blocks ``x [n, block_size, Hkv, D]`` -> (packed codes, scales): per channel
    ``[n, Hkv, D, 2]`` over the block's tokens, or per token ``[n, block_size, Hkv, 2]``."""
    if fmt.keys_per_channel:
        codes, scale, zero = quantize_asym(x, fmt.key_bits, dim=1)  # [n, 1, Hkv, D]
        scales = torch.stack([scale[:, 0], zero[:, 0]], dim=-1)
    else:
        codes, scale, zero = quantize_asym(x, fmt.key_bits, dim=-1)
        scales = torch.cat([scale, zero], dim=-1)
    return pack(codes, fmt.key_bits), scales


def quantize_values(x: torch.Tensor, fmt: BlockFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., Hkv, D]`` -> (packed codes, scales ``[..., Hkv, 2]``), per token."""
    codes, scale, zero = quantize_asym(x, fmt.value_bits, dim=-1)
    return pack(codes, fmt.value_bits), torch.cat([scale, zero], dim=-1)


def dequantize_keys(codes: torch.Tensor, scales: torch.Tensor, fmt: BlockFormat,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize_keys`` for blocks ``[n, block_size, Hkv, Dp]``."""
    values = unpack(codes, fmt.key_bits)
    s = scales.float()
    if fmt.keys_per_channel:  # [n, Hkv, D, 2] -> broadcast over the block's tokens
        return torch.addcmul(s[:, None, ..., 1], values, s[:, None, ..., 0]).to(dtype)
    return torch.addcmul(s[..., 1:2], values, s[..., 0:1]).to(dtype)


def dequantize_values(codes: torch.Tensor, scales: torch.Tensor, fmt: BlockFormat,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    values = unpack(codes, fmt.value_bits)
    s = scales.float()
    return torch.addcmul(s[..., 1:2], values, s[..., 0:1]).to(dtype)


def key_step(scales: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """The quantization step of every key element's group (per channel: [n, 1, Hkv, D])."""
    if fmt.keys_per_channel:
        return scales[:, None, ..., 0].float()
    return scales[..., 0:1].float()


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
    v_codes: torch.Tensor
    v_scales: torch.Tensor
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
                            self.k_scales.index_select(0, pages), fmt, dtype)
        v = dequantize_values(self.v_codes.index_select(0, pages),
                              self.v_scales.index_select(0, pages), fmt, dtype)
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
        codes, scales = quantize_keys(k, self.fmt)
        self.k_codes.index_copy_(0, blocks, codes)
        self.k_scales.index_copy_(0, blocks, scales)
        codes, scales = quantize_values(v, self.fmt)
        self.v_codes.index_copy_(0, blocks, codes)
        self.v_scales.index_copy_(0, blocks, scales)
