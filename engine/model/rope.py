"""Rotary position embedding (the HF "rotate_half" layout), with default, linear, llama3 and
LongRoPE frequency scaling, over a whole head or its first ``rotary_dim`` dims (Phi-3's
partial rotary). Frequencies are computed in float32 exactly as transformers does, so the
forward matches it bit for bit in float32."""

from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float,
                        scaling: dict[str, Any] | None) -> torch.Tensor:
    """[head_dim // 2] float32 inverse frequencies after scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    if rope_type == "longrope":  # the short factors: positions inside the pretraining length
        return longrope_frequencies(head_dim, theta, scaling["short_factor"])
    return inv_freq


def longrope_frequencies(rotary_dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    """LongRoPE: each frequency divided by its own rescale factor (short or long set)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta ** exponents)


def _llama3_scale(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    factor = float(s["factor"])
    low, high = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Applies RoPE to q [T, H, D] and k [T, Hkv, D] at arbitrary positions [T], over the
    first ``rotary_dim`` (= len(cos)) dims of each head.

    LongRoPE picks its factors per token: the short ones at positions inside the pretraining
    length (``original_max_position_embeddings``), the long ones past it, and scales cos and
    sin by ``attention_factor``. transformers instead re-encodes the WHOLE sequence with the
    long factors once it outgrows the pretraining length (its generate drops the cache); a
    paged cache keeps the keys it wrote, so the two agree exactly up to that length."""

    def __init__(self, rotary_dim: int, theta: float, scaling: dict[str, Any] | None,
                 device: torch.device) -> None:
        self.inv_freq = inverse_frequencies(rotary_dim, theta, scaling).to(device)
        self.long_inv_freq: torch.Tensor | None = None
        self.long_from = 0
        self.scale = 1.0
        if (scaling or {}).get("rope_type") == "longrope":
            self.long_inv_freq = longrope_frequencies(rotary_dim, theta,
                                                      scaling["long_factor"]).to(device)
            self.long_from = int(scaling["original_max_position_embeddings"])
            self.scale = float(scaling["attention_factor"])

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        pos = positions.to(torch.float32)[:, None]
        freqs = pos * self.inv_freq[None, :]
        if self.long_inv_freq is not None:
            long = (positions >= self.long_from)[:, None]
            freqs = torch.where(long, pos * self.long_inv_freq[None, :], freqs)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        # [T, 1, rotary_dim]: broadcast over heads.
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot = cos.shape[-1]
        if rot < x.shape[-1]:  # partial rotary: the rest of each head passes through
            return torch.cat((RotaryEmbedding.apply(x[..., :rot], cos, sin), x[..., rot:]),
                             dim=-1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin
