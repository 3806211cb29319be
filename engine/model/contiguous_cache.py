"""ContiguousKVCache: an AttentionBackend for ONE sequence with per-layer K/V tensors
preallocated to max_len. The correctness reference for the paged cache."""

from __future__ import annotations

import torch

from kvscope.engine.model.config import ModelConfig
from kvscope.kernels.contiguous import contiguous_attention


class ContiguousKVCache:
    """Invariant: positions [0, num_tokens) of every layer hold the keys/values of the tokens
    fed so far. A forward over T tokens must use positions num_tokens .. num_tokens+T-1;
    the call for the last layer commits them (num_tokens += T)."""

    def __init__(self, config: ModelConfig, max_len: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        shape = (max_len, config.num_kv_heads, config.head_dim)
        self.k = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.v = [torch.empty(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        self.max_len = max_len
        self.num_layers = config.num_layers
        self.scale = config.attn_scale
        self.num_tokens = 0
        self.windows = config.layer_windows

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        start, end = self.num_tokens, self.num_tokens + q.shape[0]
        if end > self.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds the cache's {self.max_len}")
        self.k[layer_idx][start:end] = k
        self.v[layer_idx][start:end] = v
        out = contiguous_attention(q, self.k[layer_idx], self.v[layer_idx], start, self.scale,
                                   window=self.windows[layer_idx])
        if layer_idx == self.num_layers - 1:
            self.num_tokens = end
        return out
