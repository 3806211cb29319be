"""Paged KV-cache kernels: Triton on CUDA, the pure-torch reference on CPU.

Cache layout per layer: K and V ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD);
slot = block * block_size + offset; slot -1 = padding. The four calls below pick their
backend from the tensors' device (see ``kernels.backend`` for the overrides:
``force_backend("triton" | "reference")`` and ``KVSCOPE_KERNELS``). Triton is imported only
when a Triton kernel actually runs, so CPU-only use never pays for it. Nothing here imports
``engine``.

Interface stability: the positional arguments are fixed. Options are keyword-only; the
quantized page formats will add ``k_scale``/``v_scale`` (per token-head scales, quantized in
``reshape_and_cache``, dequantized in ``paged_attention``) the same way, inferring the page
format from the cache dtype, so existing callers keep working.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kernels import reference
from kernels.backend import force_backend, select_backend

__all__ = ["reshape_and_cache", "paged_attention", "copy_blocks", "swap_blocks",
           "force_backend", "select_backend"]


def _impl(device: torch.device) -> ModuleType:
    if select_backend(device) == "reference":
        return reference
    from kernels import triton_backend  # lazy: imports triton

    return triton_backend


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value [T, Hkv, D]`` into their slots ``slot_mapping [T]`` (int64), in
    place, cast to the cache dtype; slots < 0 are skipped."""
    _impl(k_cache.device).reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, scale: float, *,
                    out: torch.Tensor | None = None, max_seq_len: int | None = None,
                    num_splits: int | None = None) -> torch.Tensor:
    """Causal paged attention for prefill with cached context, chunked prefill and decode.

    q ``[T, Hq, D]``; block_tables ``[B, max_blocks]`` int32; seq_lens ``[B]`` int32 (tokens
    in the cache including this step's); cu_seqlens_q ``[B+1]`` int32 (every q_len >= 1).
    Query i of sequence b sees keys < seq_len - q_len + i + 1. Returns ``[T, Hq, D]`` in q's
    dtype. When T == B (all q_len == 1) the Triton backend takes its split-K decode path.
    Keyword options (Triton only, ignored by the reference): ``max_seq_len``, the longest
    sequence, sizes the decode splits (default: block_tables width * block_size, which needs
    no device sync; a wrong value only unbalances the splits), ``num_splits`` fixes the
    decode split count; ``out`` receives the result.
    """
    return _impl(q.device).paged_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                           cu_seqlens_q, scale, out=out,
                                           max_seq_len=max_seq_len, num_splits=num_splits)


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """Copy-on-write: page ``block_mapping[i, 0]`` -> ``block_mapping[i, 1]`` in every layer's
    K and V cache. No dst may also be a src in the same call."""
    if not k_caches:
        return
    _impl(k_caches[0].device).copy_blocks(k_caches, v_caches, block_mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy pages ``src[m[i, 0]] -> dst[m[i, 1]]`` between devices (GPU <-> CPU) in one batched
    gather + transfer + scatter. The same torch code serves both backends: a copy engine job,
    not a kernel."""
    reference.swap_blocks(src, dst, block_mapping)
