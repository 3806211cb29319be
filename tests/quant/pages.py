"""Quantized page pools for tests: write random K/V through the reference kernel, and the
dequantized twin of a pool (plain fp32 pages holding exactly what the codes mean)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.kernels import quant, reference

FORMATS = ("fp8", "int8", "int4")


@dataclass
class QuantPages:
    fmt: str
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (quant.dequantize(self.k_cache, self.k_scale, self.fmt),
                quant.dequantize(self.v_cache, self.v_scale, self.fmt))

    def to(self, device: str) -> QuantPages:
        def mv(t):
            return None if t is None else t.to(device)
        return QuantPages(self.fmt, mv(self.k_cache), mv(self.v_cache), mv(self.k_scale),
                          mv(self.v_scale))

    @property
    def scales(self) -> dict:
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}


def empty_pages(fmt: str, num_blocks: int, block_size: int, num_kv_heads: int,
                head_dim: int) -> QuantPages:
    dtype = quant.cache_dtype(fmt, torch.float32)
    shape = (num_blocks, block_size, num_kv_heads, quant.packed_dim(fmt, head_dim))
    k, v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    p = quant.scale_params(fmt)
    if p:
        ks = torch.zeros(*shape[:3], p, dtype=quant.SCALE_DTYPE)
        vs = torch.zeros(*shape[:3], p, dtype=quant.SCALE_DTYPE)
    elif fmt == "fp8":  # per-head and per-tensor scales, both forms of the API
        ks = torch.linspace(0.5, 2.0, num_kv_heads)
        vs = torch.tensor(0.25)
    else:
        ks = vs = None
    return QuantPages(fmt, k, v, ks, vs)


def filled_pages(fmt: str, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, seed: int = 0) -> QuantPages:
    """Every slot written once (in shuffled order) with random tokens, keys with a few
    outlier channels like a real model's."""
    gen = torch.Generator().manual_seed(seed)
    pages = empty_pages(fmt, num_blocks, block_size, num_kv_heads, head_dim)
    n = num_blocks * block_size
    key = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    key[:, :, 1] *= 8.0
    value = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    reference.reshape_and_cache(key, value, pages.k_cache, pages.v_cache,
                                torch.randperm(n, generator=gen), **pages.scales)
    return pages
