"""Triton page writers: ``reshape_and_cache`` (new tokens into their slots) and
``copy_blocks`` (copy-on-write page copies).

Offsets are int64 and every access is masked. Slots outside [0, num_blocks * block_size) --
padding (-1) or a caller bug -- are skipped rather than written out of bounds; the
reference raises on the bug case, which is where the tests catch it. Same contracts as
``kernels.reference``.

Quantized pages (``kernels.quant``): FORMAT 1 fp8 (per-head scale), 2 int8, 3 int4. A
program holds all KV heads of its token, so the per-token-head amax / min / max reductions
are row reductions of the [heads, dims] tile; int4 loads even and odd elements as two
tiles and packs them into one byte. Same arithmetic as the torch reference (scale rounded
up, zero rounded down to fp16, floor(v + 0.5)), so both backends write the same codes up
to the last bit of a division.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscope.kernels import quant, validate

FORMAT_IDS = {"auto": 0, "fp8": 1, "int8": 2, "int4": 3}
# The constants of kernels.quant for the kernels (a jit function may read only constexpr
# globals).
_INT8_MUL = tl.constexpr((1.0 + 2.0 ** -10) / quant.INT8_MAX)
_INT4_MUL = tl.constexpr((1.0 + 2.0 ** -10) / quant.INT4_LEVELS)
_DOWN = tl.constexpr(2.0 ** -10)
_SCALE_MIN = tl.constexpr(quant.SCALE_MIN)
_SCALE_MAX = tl.constexpr(quant.SCALE_MAX)
_FP8_MAX = tl.constexpr(quant.FP8_MAX)


@triton.jit
def _round_to_e4m3(y):
    """Round fp32 ``y`` (|y| <= 448) to the nearest e4m3 value, ties to even, in fp32.

    The cast that follows is then exact, so Triton writes torch's codes: the interpreter's
    own fp32 -> fp8 cast mis-rounds (7.8 -> 4.0, a lost mantissa carry). e4m3 keeps 3
    mantissa bits; below 2^-6 it is subnormal with a fixed step of 2^-9.
    """
    exponent = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 3)
    v = y / step  # exact: a power of two
    r = tl.floor(v + 0.5)
    tie_to_odd = ((r - v) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) == 1.0)
    return tl.where(tie_to_odd, r - 1.0, r) * step


@triton.jit
def _write_token(src_ptr, token, stride_t, stride_h, stride_d,
                 cache_ptr, block, within, stride_cb, stride_cs, stride_ch, stride_cd,
                 scale_ptr, stride_sb, stride_ss, stride_sh, stride_sp, num_kv_heads,
                 HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                 FORMAT: tl.constexpr):
    """Write one token's [Hkv, HEAD_DIM] vectors into its slot in one cache, quantized."""
    heads = tl.arange(0, BLOCK_H).to(tl.int64)
    h_mask = heads < num_kv_heads
    src = src_ptr + token * stride_t + heads[:, None] * stride_h
    dst = cache_ptr + block * stride_cb + within * stride_cs + heads[:, None] * stride_ch
    scale_dst = scale_ptr + block * stride_sb + within * stride_ss + heads * stride_sh
    if FORMAT == 3:  # int4: element 2i -> low nibble of byte i, 2i+1 -> high nibble
        half = tl.arange(0, BLOCK_D // 2).to(tl.int64)
        mask = h_mask[:, None] & (half < HEAD_DIM // 2)[None, :]
        xe = tl.load(src + (2 * half)[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
        xo = tl.load(src + (2 * half + 1)[None, :] * stride_d, mask=mask,
                     other=0.0).to(tl.float32)
        lo = tl.min(tl.where(mask, tl.minimum(xe, xo), float("inf")), axis=1)
        hi = tl.max(tl.where(mask, tl.maximum(xe, xo), float("-inf")), axis=1)
        lo = tl.where(h_mask, lo, 0.0)
        hi = tl.where(h_mask, hi, 0.0)
        zero = tl.minimum(tl.maximum(lo - tl.abs(lo) * _DOWN, -_SCALE_MAX), _SCALE_MAX)
        zero = zero.to(tl.float16).to(tl.float32)
        scale = tl.minimum(tl.maximum((hi - zero) * _INT4_MUL, _SCALE_MIN), _SCALE_MAX)
        scale = scale.to(tl.float16).to(tl.float32)
        qe = tl.floor((xe - zero[:, None]) / scale[:, None] + 0.5)
        qo = tl.floor((xo - zero[:, None]) / scale[:, None] + 0.5)
        qe = tl.minimum(tl.maximum(qe, 0.0), 15.0).to(tl.uint8)
        qo = tl.minimum(tl.maximum(qo, 0.0), 15.0).to(tl.uint8)
        tl.store(dst + half[None, :] * stride_cd, qe | (qo << 4), mask=mask)
        tl.store(scale_dst, scale.to(tl.float16), mask=h_mask)
        tl.store(scale_dst + stride_sp, zero.to(tl.float16), mask=h_mask)
    else:
        dims = tl.arange(0, BLOCK_D).to(tl.int64)
        mask = h_mask[:, None] & (dims < HEAD_DIM)[None, :]
        x = tl.load(src + dims[None, :] * stride_d, mask=mask, other=0.0)
        dst = dst + dims[None, :] * stride_cd
        if FORMAT == 0:
            tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=mask)
        elif FORMAT == 1:  # fp8: per-head scale, saturate at +-448
            s = tl.load(scale_ptr + heads * stride_sh, mask=h_mask, other=1.0)
            y = x.to(tl.float32) / s[:, None]
            y = _round_to_e4m3(tl.minimum(tl.maximum(y, -_FP8_MAX), _FP8_MAX))
            tl.store(dst, y.to(cache_ptr.dtype.element_ty), mask=mask)
        else:  # int8: symmetric, scale = amax / 127 rounded up to fp16
            x = x.to(tl.float32)
            amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1)
            scale = tl.minimum(tl.maximum(amax * _INT8_MUL, _SCALE_MIN), _SCALE_MAX)
            scale = scale.to(tl.float16).to(tl.float32)
            q = tl.floor(x / scale[:, None] + 0.5)
            q = tl.minimum(tl.maximum(q, -127.0), 127.0).to(tl.int8)
            tl.store(dst, q, mask=mask)
            tl.store(scale_dst, scale.to(tl.float16), mask=h_mask)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    num_slots, block_size, num_kv_heads,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    stride_ksb, stride_kss, stride_ksh, stride_ksp,
    stride_vsb, stride_vss, stride_vsh, stride_vsp,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FORMAT: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (slot < 0) | (slot >= num_slots):
        return
    block = slot // block_size
    within = slot % block_size
    _write_token(key_ptr, token, stride_kt, stride_kh, stride_kd,
                 k_cache_ptr, block, within, stride_kcb, stride_kcs, stride_kch, stride_kcd,
                 k_scale_ptr, stride_ksb, stride_kss, stride_ksh, stride_ksp, num_kv_heads,
                 HEAD_DIM, BLOCK_H, BLOCK_D, FORMAT)
    _write_token(value_ptr, token, stride_vt, stride_vh, stride_vd,
                 v_cache_ptr, block, within, stride_vcb, stride_vcs, stride_vch, stride_vcd,
                 v_scale_ptr, stride_vsb, stride_vss, stride_vsh, stride_vsp, num_kv_heads,
                 HEAD_DIM, BLOCK_H, BLOCK_D, FORMAT)


def scale_args(fmt: str, cache: torch.Tensor, scale: torch.Tensor | None,
               ) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
    """A scale tensor and its 4 strides (block, slot, head, param) as the kernels read it:
    per-token pages as they are; an fp8 scale as a contiguous [Hkv] vector (head stride 1);
    auto: the cache itself as a never-read placeholder."""
    if fmt == "fp8":
        vec = quant.fp8_scale_view(scale, cache.shape[2], cache.device).contiguous()
        return vec, (0, 0, 1, 0)
    if fmt == "auto":
        return cache, (0, 0, 0, 0)
    return scale, tuple(scale.stride())


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                      k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    validate.check_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
    fmt = validate.check_scales(k_cache, k_scale, v_scale)
    if key.shape[0] == 0:
        return
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    head_dim = quant.head_dim_of(k_cache)
    ks, ks_strides = scale_args(fmt, k_cache, k_scale)
    vs, vs_strides = scale_args(fmt, v_cache, v_scale)
    _reshape_and_cache_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping, ks, vs,
        num_blocks * block_size, block_size, num_kv_heads,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        *ks_strides, *vs_strides,
        HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=max(2, triton.next_power_of_2(head_dim)), FORMAT=FORMAT_IDS[fmt])


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
                block_mapping: torch.Tensor, *, k_scales: list[torch.Tensor] | None = None,
                v_scales: list[torch.Tensor] | None = None) -> None:
    """One launch per cache tensor (2 per layer, 4 with per-token scale pages); each page
    must be one contiguous span. The copy is dtype-blind: fp8 pages are copied as bytes."""
    tensors = validate.check_copy_blocks(k_caches, v_caches, block_mapping, k_scales, v_scales)
    if block_mapping.numel() == 0:
        return
    mapping = block_mapping.contiguous()
    caches = [t.view(torch.uint8) if t.dtype == quant.FP8_DTYPE else t for t in tensors]
    for cache in caches:
        if not cache[0].is_contiguous():
            raise ValueError("copy_blocks needs each page [block_size, Hkv, D] contiguous")
    for cache in caches:
        block_numel = cache[0].numel()
        chunk = min(4096, triton.next_power_of_2(block_numel))
        grid = (mapping.shape[0], triton.cdiv(block_numel, chunk))
        _copy_blocks_kernel[grid](cache, mapping, cache.shape[0], cache.stride(0), block_numel,
                                  BLOCK=chunk)


@triton.jit
def _demote_scatter_kernel(values_ptr, dst_codes_ptr, i8_ptr, i4_ptr, scale_ptr,
                           stride_vn, stride_vs, stride_vh, stride_vd,
                           stride_b, stride_s, stride_h,
                           stride_sb, stride_ss, stride_sh, stride_sp, num_kv_heads,
                           KSUB: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    """Program (page i, token t): quantize row t of ``values[i]`` (all KV heads) into the
    int8/int4 sub-page its destination code names (kernels.mixed_pages), scales with it."""
    i = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1).to(tl.int64)
    code = tl.load(dst_codes_ptr + i).to(tl.int64)
    fid = code & 3
    slot = code >> 2
    frame = slot // KSUB
    sub = slot % KSUB
    src = values_ptr + i * stride_vn
    if fid == 2:
        _write_token(src, t, stride_vs, stride_vh, stride_vd,
                     i8_ptr + sub * HEAD_DIM, frame, t, stride_b, stride_s, stride_h, 1,
                     scale_ptr + sub * stride_sp, stride_sb, stride_ss, stride_sh, stride_sp,
                     num_kv_heads, HEAD_DIM, BLOCK_H, BLOCK_D, 2)
    elif fid == 3:
        _write_token(src, t, stride_vs, stride_vh, stride_vd,
                     i4_ptr + sub * (HEAD_DIM // 2), frame, t, stride_b, stride_s, stride_h, 1,
                     scale_ptr + 2 * sub * stride_sp, stride_sb, stride_ss, stride_sh,
                     stride_sp, num_kv_heads, HEAD_DIM, BLOCK_H, BLOCK_D, 3)


def demote_scatter(layout, arena: torch.Tensor, scales: torch.Tensor, values: torch.Tensor,
                   dst_codes: torch.Tensor) -> None:
    """Phase 2 of a batched demotion (kernels.mixed_pages.demote): quantize the gathered
    pages ``values [N, bs, Hkv, D]`` (fp32) into their int8/int4 destinations, one launch
    of N x block_size programs. Same codes and scales as the torch path."""
    n, bs, hkv, d = values.shape
    if n == 0:
        return
    views = layout.views(arena)
    _demote_scatter_kernel[(n, bs)](
        values, dst_codes.contiguous(), views["int8"], views["int4"], scales,
        *values.stride(), arena.stride(0), arena.stride(1), arena.stride(2),
        *scales.stride(), hkv, KSUB=layout.max_subs, HEAD_DIM=d,
        BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=max(2, triton.next_power_of_2(d)))
