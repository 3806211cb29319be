"""The seam between the model and the KV cache: the model computes q/k/v, an
AttentionBackend stores k/v wherever its cache lives and returns attention outputs."""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    """Called once per layer per forward as ``attn(layer_idx, q, k, v)``.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim], RoPE already applied;
    T tokens may belong to several sequences (the backend knows which, the model does not).
    The backend writes k/v into its cache and returns [T, num_heads, head_dim] in q's dtype,
    each token attending causally to its own sequence's cached keys and itself.
    Layers are called in order 0..num_layers-1 within one forward.
    """

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor: ...
