"""Triton page writers: ``reshape_and_cache`` (new tokens into their slots) and
``copy_blocks`` (copy-on-write page copies).

Offsets are int64 and every access is masked. Slots outside [0, num_blocks * block_size) --
padding (-1) or a caller bug -- are skipped rather than written out of bounds; the
reference raises on the bug case, which is where the tests catch it. Same contracts as
``kernels.reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import validate


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    num_slots, block_size, num_kv_heads,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    block = slot // block_size
    within = slot % block_size
    heads = tl.arange(0, BLOCK_H).to(tl.int64)
    dims = tl.arange(0, BLOCK_D).to(tl.int64)
    mask = (heads < num_kv_heads)[:, None] & (dims < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh
                + dims[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh
                + dims[None, :] * stride_vd, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + within * stride_kcs
    tl.store(k_dst + heads[:, None] * stride_kch + dims[None, :] * stride_kcd,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v_dst = v_cache_ptr + block * stride_vcb + within * stride_vcs
    tl.store(v_dst + heads[:, None] * stride_vch + dims[None, :] * stride_vcd,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    validate.check_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
    if key.shape[0] == 0:
        return
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    _reshape_and_cache_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping,
        num_blocks * block_size, block_size, num_kv_heads,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim))


@triton.jit
def _copy_blocks_kernel(cache_ptr, block_mapping_ptr, num_blocks, stride_block, block_numel,
                        BLOCK: tl.constexpr):
    """Program (pair, chunk): copy one BLOCK-element chunk of page src to page dst."""
    pair = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    src = tl.load(block_mapping_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1).to(tl.int64)
    if (src < 0) | (src >= num_blocks) | (dst < 0) | (dst >= num_blocks):
        return
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    data = tl.load(cache_ptr + src * stride_block + offs, mask=mask)
    tl.store(cache_ptr + dst * stride_block + offs, data, mask=mask)


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                block_mapping: torch.Tensor) -> None:
    """One launch per cache tensor (2 per layer); each page must be one contiguous span."""
    validate.check_copy_blocks(k_caches, v_caches, block_mapping)
    if block_mapping.numel() == 0:
        return
    mapping = block_mapping.contiguous()
    caches = (*k_caches, *v_caches)
    for cache in caches:
        if not cache[0].is_contiguous():
            raise ValueError("copy_blocks needs each page [block_size, Hkv, D] contiguous")
    for cache in caches:
        block_numel = cache[0].numel()
        chunk = min(4096, triton.next_power_of_2(block_numel))
        grid = (mapping.shape[0], triton.cdiv(block_numel, chunk))
        _copy_blocks_kernel[grid](cache, mapping, cache.shape[0], cache.stride(0), block_numel,
                                  BLOCK=chunk)
