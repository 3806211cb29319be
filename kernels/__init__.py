"""Paged KV-cache kernels: Triton on CUDA, the pure-torch reference on CPU.

Cache layout per layer: K and V ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD);
slot = block * block_size + offset; slot -1 = padding. The four calls below pick their
backend from the tensors' device (see ``kernels.backend`` for the overrides:
``force_backend("triton" | "reference")`` and ``KVSCOPE_KERNELS``). Triton is imported only
when a Triton kernel actually runs, so CPU-only use never pays for it. Nothing here imports
``engine``.

Interface stability: the positional arguments are fixed. Options are keyword-only.

Quantized pages (``kernels.quant`` defines them): the page format follows from the cache
dtype -- float (auto), ``float8_e4m3fn`` (fp8), ``int8`` (int8), ``uint8`` with head_dim / 2
bytes (int4, two values per byte). Scales are keyword-only: ``k_scale``/``v_scale`` for one
layer (fp8: fp32 per-head ``[Hkv]`` or one value, default 1.0; int8/int4: the per-token
scale pages ``[num_blocks, block_size, Hkv, P]`` fp16, P = 1 (scale) or 2 (scale, zero),
required); ``k_scales``/``v_scales`` (lists, one per layer) for ``copy_blocks``.
``reshape_and_cache`` quantizes and writes scales with the token; ``paged_attention``
dequantizes inside the kernel. Scale pages are swapped with ``swap_blocks`` like any page.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kvscope.kernels import reference, swap_runs
from kvscope.kernels.backend import force_backend, select_backend

__all__ = ["reshape_and_cache", "paged_attention", "copy_blocks", "swap_blocks",
           "force_backend", "select_backend"]


def _impl(device: torch.device) -> ModuleType:
    if select_backend(device) == "reference":
        return reference
    from kvscope.kernels import triton_backend  # lazy: imports triton

    return triton_backend


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                      k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """Write ``key``/``value [T, Hkv, D]`` into their slots ``slot_mapping [T]`` (int64), in
    place, cast to the cache dtype or quantized (int8/int4 write the token's scales into
    ``k_scale``/``v_scale`` at the same slot); slots < 0 are skipped."""
    _impl(k_cache.device).reshape_and_cache(key, value, k_cache, v_cache, slot_mapping,
                                            k_scale=k_scale, v_scale=v_scale)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, scale: float, *,
                    out: torch.Tensor | None = None, max_seq_len: int | None = None,
                    num_splits: int | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None,
                    window: int | None = None) -> torch.Tensor:
    """Causal paged attention for prefill with cached context, chunked prefill and decode.

    q ``[T, Hq, D]``; block_tables ``[B, max_blocks]`` int32; seq_lens ``[B]`` int32 (tokens
    in the cache including this step's); cu_seqlens_q ``[B+1]`` int32 (every q_len >= 1).
    Query i of sequence b sees keys < seq_len - q_len + i + 1. Returns ``[T, Hq, D]`` in q's
    dtype. When T == B (all q_len == 1) the Triton backend takes its split-K decode path.
    Keyword options (Triton only, ignored by the reference): ``max_seq_len``, the longest
    sequence, sizes the decode splits (default: block_tables width * block_size, which needs
    no device sync; a wrong value only unbalances the splits), ``num_splits`` fixes the
    decode split count; ``out`` receives the result. ``k_scale``/``v_scale``: the scales of
    quantized pages (module docstring). ``window`` W: sliding-window attention, query i
    also sees only keys > seq_len - q_len + i - W.
    """
    return _impl(q.device).paged_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                           cu_seqlens_q, scale, out=out,
                                           max_seq_len=max_seq_len, num_splits=num_splits,
                                           k_scale=k_scale, v_scale=v_scale, window=window)


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                block_mapping: torch.Tensor, *, k_scales: list[torch.Tensor] | None = None,
                v_scales: list[torch.Tensor] | None = None) -> None:
    """Copy-on-write: page ``block_mapping[i, 0]`` -> ``block_mapping[i, 1]`` in every layer's
    K and V cache, and in its per-token scale pages (required for int8/int4). No dst may
    also be a src in the same call."""
    if not k_caches:
        return
    _impl(k_caches[0].device).copy_blocks(k_caches, v_caches, block_mapping,
                                          k_scales=k_scales, v_scales=v_scales)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy pages ``src[m[i, 0]] -> dst[m[i, 1]]`` between devices (GPU <-> CPU) in one batched
    gather + transfer + scatter (``reference.swap_blocks``, its meaning). Between a GPU and
    pinned host pages whose host ids run in mostly consecutive spans, one copy per span
    (``kernels.swap_runs``). Copy engine work, not a kernel: the same torch code on every
    backend."""
    mapping = reference.checked_swap_mapping(src, dst, block_mapping)
    if mapping is None:
        return
    if src.device.type == "cuda" and dst.device.type == "cpu" and dst.is_pinned():
        spans = swap_runs.runs(mapping[:, 1])
        if swap_runs.worth_it(spans, len(mapping)):
            swap_runs.to_host(reference.raw(src), reference.raw(dst), mapping[:, 0], spans)
            return
    if src.device.type == "cpu" and dst.device.type == "cuda" and src.is_pinned():
        spans = swap_runs.runs(mapping[:, 0])
        if swap_runs.worth_it(spans, len(mapping)):
            swap_runs.to_device(reference.raw(src), reference.raw(dst), mapping[:, 1], spans)
            return
    reference.swap_blocks(src, dst, mapping)
