"""Argument checks shared by both backends.

Only shapes, dtypes and devices are checked here: these are host-side facts, free to read
on any device. Checks that need tensor *values* (slot ranges, block ids) cost a device sync
on CUDA, so only the reference (which runs on CPU) makes them; the Triton kernels instead
mask every load and skip out-of-range slots, so a bad value never writes out of bounds.
Every check runs before anything is written: a rejected call leaves the caches untouched.
"""

from __future__ import annotations

import torch

from kvscope.kernels import quant

_INDEX_DTYPES = (torch.int32, torch.int64)


def _fail(msg: str) -> None:
    raise ValueError(msg)


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """K and V pages: same shape, dtype and device, 4-D NHD [num_blocks, block_size, Hkv, D]."""
    if k_cache.dim() != 4:
        _fail(f"k_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
              f"got shape {tuple(k_cache.shape)}")
    if k_cache.shape != v_cache.shape:
        _fail(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if k_cache.dtype != v_cache.dtype or k_cache.device != v_cache.device:
        _fail(f"k_cache ({k_cache.dtype}, {k_cache.device}) and v_cache "
              f"({v_cache.dtype}, {v_cache.device}) differ in dtype or device")
    if k_cache.dtype not in quant.CACHE_DTYPES:
        _fail(f"cache dtype {k_cache.dtype} is not a page format; use one of "
              f"{[str(d) for d in quant.CACHE_DTYPES]}")


def check_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None) -> str:
    """The scales a cache's format needs (see ``kernels.quant``); returns the format.

    int8/int4: per-token ``[num_blocks, block_size, Hkv, P]`` fp16 (P = 1 or 2), required;
    fp8: optional fp32 per-head ``[Hkv]`` or per-tensor (0-d / ``[1]``); auto: none.
    """
    fmt = quant.format_of(k_cache)
    params = quant.scale_params(fmt)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if fmt == "auto":
            if s is not None:
                _fail(f"{name} given for an unquantized {k_cache.dtype} cache")
        elif fmt == "fp8":
            if s is not None and (s.dtype != torch.float32 or s.device != k_cache.device
                                  or s.numel() not in (1, k_cache.shape[2]) or s.dim() > 1):
                _fail(f"{name} for fp8 pages must be fp32 [{k_cache.shape[2]}] (per head) or "
                      f"one value on {k_cache.device}, got {s.dtype} {tuple(s.shape)} on "
                      f"{s.device}")
        else:
            want = (*k_cache.shape[:3], params)
            if s is None:
                _fail(f"{fmt} pages need {name} {want} ({quant.SCALE_DTYPE}): per-token scales")
            if tuple(s.shape) != want or s.dtype != quant.SCALE_DTYPE or s.device != k_cache.device:
                _fail(f"{name} must be {want} {quant.SCALE_DTYPE} on {k_cache.device}, got "
                      f"{tuple(s.shape)} {s.dtype} on {s.device}")
    return fmt


def check_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    check_cache_pair(k_cache, v_cache)
    num_kv_heads, head_dim = k_cache.shape[2], quant.head_dim_of(k_cache)
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_dim):
        _fail(f"key must be [T, {num_kv_heads}, {head_dim}], got {tuple(key.shape)}")
    if value.shape != key.shape:
        _fail(f"value {tuple(value.shape)} must match key {tuple(key.shape)}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        _fail(f"slot_mapping must be [T={key.shape[0]}], got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in _INDEX_DTYPES:
        _fail(f"slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    for name, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)):
        if t.device != k_cache.device:
            _fail(f"{name} is on {t.device} but the cache is on {k_cache.device}")


def check_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor,
                          cu_seqlens_q: torch.Tensor) -> None:
    check_cache_pair(k_cache, v_cache)
    num_kv_heads, head_dim = k_cache.shape[2], quant.head_dim_of(k_cache)
    if q.dim() != 3 or q.shape[2] != head_dim:
        _fail(f"q must be [T, num_heads, {head_dim}], got {tuple(q.shape)}")
    if q.shape[1] % num_kv_heads != 0:
        _fail(f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}")
    if not q.dtype.is_floating_point:
        _fail(f"q must be floating point, got {q.dtype}")
    if block_tables.dim() != 2:
        _fail(f"block_tables must be [B, max_blocks], got {tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape != (num_seqs,):
        _fail(f"seq_lens must be [B={num_seqs}], got {tuple(seq_lens.shape)}")
    if cu_seqlens_q.shape != (num_seqs + 1,):
        _fail(f"cu_seqlens_q must be [B+1={num_seqs + 1}], got {tuple(cu_seqlens_q.shape)}")
    if num_seqs == 0:
        _fail("empty batch: B must be >= 1")
    if q.shape[0] < num_seqs:
        _fail(f"{q.shape[0]} query tokens for {num_seqs} sequences: every sequence needs "
              f"q_len >= 1")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("cu_seqlens_q", cu_seqlens_q)):
        if t.dtype not in _INDEX_DTYPES:
            _fail(f"{name} must be int32/int64, got {t.dtype}")
    for name, t in (("q", q), ("block_tables", block_tables), ("seq_lens", seq_lens),
                    ("cu_seqlens_q", cu_seqlens_q)):
        if t.device != k_cache.device:
            _fail(f"{name} is on {t.device} but the cache is on {k_cache.device}")


def check_block_mapping(block_mapping: torch.Tensor) -> None:
    if block_mapping.dim() != 2 or block_mapping.shape[1] != 2:
        _fail(f"block_mapping must be [N, 2] (src, dst), got {tuple(block_mapping.shape)}")
    if block_mapping.dtype not in _INDEX_DTYPES:
        _fail(f"block_mapping must be int32/int64, got {block_mapping.dtype}")


def check_copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                      block_mapping: torch.Tensor, k_scales: list[torch.Tensor] | None = None,
                      v_scales: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Returns every tensor whose pages are copied: caches, then per-token scales."""
    if len(k_caches) != len(v_caches):
        _fail(f"{len(k_caches)} K caches but {len(v_caches)} V caches")
    for k_cache, v_cache in zip(k_caches, v_caches, strict=True):
        check_cache_pair(k_cache, v_cache)
        if k_cache.device != block_mapping.device:
            _fail(f"block_mapping is on {block_mapping.device}, caches on {k_cache.device}")
    check_block_mapping(block_mapping)
    needs = bool(k_caches) and quant.scale_params(quant.format_of(k_caches[0])) > 0
    if not needs:
        if k_scales or v_scales:
            _fail("k_scales/v_scales given, but these pages carry no per-token scales")
        return [*k_caches, *v_caches]
    if k_scales is None or v_scales is None or not (
            len(k_scales) == len(v_scales) == len(k_caches)):
        _fail(f"{quant.format_of(k_caches[0])} pages need k_scales and v_scales, one per "
              "layer: scales travel with their block")
    for k_cache, ks, vs in zip(k_caches, k_scales, v_scales, strict=True):
        check_scales(k_cache, ks, vs)
    return [*k_caches, *v_caches, *k_scales, *v_scales]


def check_index_range(name: str, idx: torch.Tensor, upper: int) -> None:
    """Values of ``idx`` in [0, upper). Reads values: call on CPU tensors only."""
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= upper):
        _fail(f"{name} out of range [0, {upper}): min {int(idx.min())}, max {int(idx.max())}")
