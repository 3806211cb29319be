"""Causal attention for one sequence whose KV cache is one contiguous tensor (plain torch).

The reference that paged kernels are checked against: scores and softmax in float32.
"""

from __future__ import annotations

import torch


def contiguous_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         q_start: int, scale: float, *, window: int | None = None
                         ) -> torch.Tensor:
    """q: [T, H, D] for positions q_start .. q_start+T-1; k_cache, v_cache: [S, Hkv, D] with
    S >= q_start + T (entries past q_start + T are ignored). Query i attends keys
    j < q_start + i + 1. H must be a multiple of Hkv (query head h reads kv head h // (H/Hkv),
    as HF's repeat_kv does). ``window`` W (sliding-window attention): query i also sees
    only keys j > q_start + i - W, the last W positions. Returns [T, H, D] in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    seq_len = q_start + num_tokens
    if k_cache.shape[0] < seq_len or v_cache.shape[0] < seq_len:
        raise ValueError(f"cache holds {k_cache.shape[0]} positions, need {seq_len}")
    group = num_heads // num_kv_heads
    qf = q.float().view(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    kf = k_cache[:seq_len].float().permute(1, 0, 2)  # [Hkv, S, D]
    vf = v_cache[:seq_len].float().permute(1, 0, 2)
    scores = torch.matmul(qf, kf[:, None].transpose(-1, -2)) * scale  # [Hkv, G, T, S]
    query_pos = torch.arange(q_start, seq_len, device=q.device)[:, None]
    key_pos = torch.arange(seq_len, device=q.device)[None, :]
    hidden = key_pos > query_pos
    if window is not None:
        hidden |= key_pos <= query_pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, vf[:, None])  # [Hkv, G, T, D]
    return out.permute(2, 0, 1, 3).reshape(num_tokens, num_heads, head_dim).to(q.dtype)
