"""Triton paged attention: one prefill/mixed kernel and a split-K decode path.

Both read K/V straight from the pages: each tile of BLOCK_N key positions looks up its
physical page per key through the block table, so any block_size works and BLOCK_N stays a
tl.dot-friendly power of two. GQA: the GROUP query heads that share a KV head are rows of
the same tile, so each K/V tile is loaded once for all of them.

- ``_prefill_kernel``: grid (query tiles over the whole batch, Hkv). A tile is BLOCK_Q query
  tokens of one sequence x GROUP heads = BLOCK_M rows. The causal rule key < context_len +
  query_pos + 1 is applied per row; the key loop stops at the tile's last visible key.
- ``_decode_split_kernel`` + ``_decode_reduce_kernel``: when every q_len == 1 (T == B), grid
  (B, Hkv, num_splits); each split scans a slice of the context and writes its normalised
  partial output and log2-sum-exp; the reduction rescales and sums the splits per head.
  Splits past the sequence's end write lse = -inf and weigh nothing.

Quantized pages (FORMAT 1 fp8, 2 int8, 3 int4; ``kernels.quant``) are dequantized inside
the key loop: each K/V tile is loaded as codes, with its per-key scales (int8/int4: from
the scale pages, through the same page/slot as the codes; fp8: one per KV head), and
turned into fp32 (interpreter, fp32 q) or q's dtype before tl.dot. int4 tiles load each
byte for both of its nibbles (offset d // 2, shift 4 * (d % 2)).

Offsets are int64; every load is masked, and page ids outside [0, num_blocks) read as zero
instead of out of bounds. Softmax runs in base 2 with the scale folded into log2(e).
Invariant kept by the caller (checked by the reference, not here, to avoid a device sync):
cu_seqlens_q runs 0..T, every q_len >= 1, seq_len >= q_len, tables cover seq_len.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator

import torch
import triton
import triton.language as tl

from kvscope.kernels import validate
from kvscope.kernels.triton_cache import FORMAT_IDS, scale_args

LOG2E = 1.4426950408889634
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The decode split kernel's launch options (num_warps, num_stages): empty = Triton's
# defaults. Only the GPU check's attention probe varies it (``decode_launch``), to show
# whether the decode path's gap to copy bandwidth is its launch configuration.
_DECODE_LAUNCH: dict[str, int] = {}
# A row max that is finite even before any key is seen: exp2(-inf - (-inf)) would be NaN.
# (constexpr: a jit function may read only constexpr globals when compiled for a GPU)
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _load_tile(ptr, scale_ptr, page, within, kv_head, valid, offs_d, d_mask,
               stride_b, stride_s, stride_h, stride_d,
               stride_sb, stride_ss, stride_sh, stride_sp, FORMAT: tl.constexpr,
               i8_ptr, i4_ptr, HEAD_DIM: tl.constexpr, ELT: tl.constexpr,
               KSUB: tl.constexpr):
    """K or V rows of BLOCK_N key positions, [BLOCK_N, BLOCK_D]: as stored (FORMAT 0),
    else dequantized to fp32. Invalid rows read as 0 (and scale 0).

    FORMAT 4 (mixed arena, kernels.mixed_pages): ``page`` is a page code, read per key;
    ``ptr``/``i8_ptr``/``i4_ptr`` are the arena as full / int8 / int4 elements and the
    strides are the arena's, in bytes. Each key loads only its own format's lanes (the
    others are masked off, costing no memory traffic) and the three partial tiles add up."""
    if FORMAT == 4:
        fid = page & 3
        slot = page >> 2
        frame = slot // KSUB
        sub = slot % KSUB
        row_b = frame * stride_b + within * stride_s + kv_head * stride_h
        dcol = offs_d[None, :].to(tl.int64)
        dm = d_mask[None, :]
        is_full = valid & (fid == 0)
        is_i8 = valid & (fid == 2)
        is_i4 = valid & (fid == 3)
        srow_m = scale_ptr + frame * stride_sb + within * stride_ss + kv_head * stride_sh
        x = tl.load(ptr + (row_b // ELT)[:, None] + dcol, mask=is_full[:, None] & dm,
                    other=0.0).to(tl.float32)
        c8 = tl.load(i8_ptr + (row_b + sub * HEAD_DIM)[:, None] + dcol,
                     mask=is_i8[:, None] & dm, other=0).to(tl.float32)
        s8 = tl.load(srow_m + sub * stride_sp, mask=is_i8, other=0.0).to(tl.float32)
        byte = tl.load(i4_ptr + (row_b + sub * (HEAD_DIM // 2))[:, None] + dcol // 2,
                       mask=is_i4[:, None] & dm, other=0)
        c4 = ((byte.to(tl.int32) >> ((offs_d % 2) * 4)[None, :]) & 0xF).to(tl.float32)
        s4 = tl.load(srow_m + 2 * sub * stride_sp, mask=is_i4, other=0.0).to(tl.float32)
        z4 = tl.load(srow_m + (2 * sub + 1) * stride_sp, mask=is_i4, other=0.0).to(tl.float32)
        return x + c8 * s8[:, None] + (c4 * s4[:, None] + z4[:, None])
    row = page * stride_b + within * stride_s + kv_head * stride_h
    mask = valid[:, None] & d_mask[None, :]
    srow = scale_ptr + page * stride_sb + within * stride_ss + kv_head * stride_sh
    # One return at the end: every branch is static (FORMAT is constexpr).
    if FORMAT == 3:
        byte = tl.load(ptr + row[:, None] + (offs_d // 2)[None, :].to(tl.int64) * stride_d,
                       mask=mask, other=0)
        code = (byte.to(tl.int32) >> ((offs_d % 2) * 4)[None, :]) & 0xF
        scale = tl.load(srow, mask=valid, other=0.0).to(tl.float32)
        zero = tl.load(srow + stride_sp, mask=valid, other=0.0).to(tl.float32)
        tile = code.to(tl.float32) * scale[:, None] + zero[:, None]
    else:
        ptrs = ptr + row[:, None] + offs_d[None, :].to(tl.int64) * stride_d
        if FORMAT == 0:
            tile = tl.load(ptrs, mask=mask, other=0.0)
        elif FORMAT == 1:  # no `other` for fp8 loads: zero the masked lanes after the upcast
            x = tl.load(ptrs, mask=mask).to(tl.float32)
            tile = tl.where(mask, x * tl.load(scale_ptr + kv_head * stride_sh), 0.0)
        else:
            x = tl.load(ptrs, mask=mask, other=0)
            scale = tl.load(srow, mask=valid, other=0.0).to(tl.float32)
            tile = x.to(tl.float32) * scale[:, None]
    return tile


@triton.jit
def _attend_tile(q, m_i, l_i, acc, k_ptr, v_ptr, table_row_ptr, stride_bt_i, kv_head,
                 start_n, kv_end, num_blocks, block_size,
                 stride_kb, stride_ks, stride_kh, stride_kd,
                 stride_vb, stride_vs, stride_vh, stride_vd,
                 visible_upto, visible_from, scale_log2,
                 k_scale_ptr, v_scale_ptr, stride_ksb, stride_kss, stride_ksh, stride_ksp,
                 stride_vsb, stride_vss, stride_vsh, stride_vsp,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 UPCAST: tl.constexpr, CAUSAL: tl.constexpr, FORMAT: tl.constexpr,
                 k_i8_ptr, k_i4_ptr, v_i8_ptr, v_i4_ptr, ELT: tl.constexpr,
                 KSUB: tl.constexpr, WINDOWED: tl.constexpr):
    """One online-softmax step over key positions [start_n, start_n + BLOCK_N) < kv_end.

    ``visible_upto`` [rows]: a row sees key positions <= it (only used when CAUSAL);
    ``visible_from`` [rows]: and >= it (only used when WINDOWED: a sliding window).
    """
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    in_range = offs_n < kv_end
    page = tl.load(table_row_ptr + (offs_n // block_size).to(tl.int64) * stride_bt_i,
                   mask=in_range, other=0)
    valid = in_range & (page >= 0) & (page < num_blocks)
    page = page.to(tl.int64)
    within = (offs_n % block_size).to(tl.int64)
    d_mask = offs_d < HEAD_DIM
    k = _load_tile(k_ptr, k_scale_ptr, page, within, kv_head, valid, offs_d, d_mask,
                   stride_kb, stride_ks, stride_kh, stride_kd,
                   stride_ksb, stride_kss, stride_ksh, stride_ksp, FORMAT,
                   k_i8_ptr, k_i4_ptr, HEAD_DIM, ELT, KSUB)
    v = _load_tile(v_ptr, v_scale_ptr, page, within, kv_head, valid, offs_d, d_mask,
                   stride_vb, stride_vs, stride_vh, stride_vd,
                   stride_vsb, stride_vss, stride_vsh, stride_vsp, FORMAT,
                   v_i8_ptr, v_i4_ptr, HEAD_DIM, ELT, KSUB)
    if UPCAST:  # fp32 math: fp32 pages, or the interpreter (whose bf16 tl.dot is broken)
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:  # q is in the page dtype, or (quantized pages) the dequantized tiles in q's
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    s = s * scale_log2
    keep = in_range[None, :]
    if CAUSAL:
        keep = keep & (offs_n[None, :] <= visible_upto[:, None])
    if WINDOWED:
        keep = keep & (offs_n[None, :] >= visible_from[:, None])
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if UPCAST:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, cu_seqlens_q_ptr,
    scale_log2, num_seqs, num_blocks, block_size, window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt_b, stride_bt_i,
    k_scale_ptr, v_scale_ptr, stride_ksb, stride_kss, stride_ksh, stride_ksp,
    stride_vsb, stride_vss, stride_vsh, stride_vsp,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr, UPCAST: tl.constexpr, FORMAT: tl.constexpr,
    k_i8_ptr, k_i4_ptr, v_i8_ptr, v_i4_ptr, ELT: tl.constexpr, KSUB: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    # Sequence b owns tiles [cu[b] // BLOCK_Q + b, ...): an upper bound on tiles before it
    # that needs no host-side prefix sum; the grid is T // BLOCK_Q + B tiles, some empty.
    seqs = tl.arange(0, BLOCK_B)
    cu_all = tl.load(cu_seqlens_q_ptr + seqs, mask=seqs < num_seqs, other=0)
    first_tile = cu_all // BLOCK_Q + seqs
    b = tl.sum(((first_tile <= tile) & (seqs < num_seqs)).to(tl.int32), axis=0) - 1
    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    tile_q = (tile - (q_start // BLOCK_Q + b)) * BLOCK_Q
    if tile_q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    token = tile_q + rows // GROUP  # query index within the sequence
    head = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (token < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_rows = (q_start + token).to(tl.int64)
    q_off = q_rows * stride_qt + head.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :].to(tl.int64) * stride_qd,
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    elif FORMAT == 0:
        q = q.to(k_ptr.dtype.element_ty)

    visible_upto = context_len + token  # inclusive
    visible_from = visible_upto - window + 1  # inclusive (WINDOWED only)
    kv_end = context_len + tl.minimum(tile_q + BLOCK_Q, q_len)
    kv_start = 0
    if WINDOWED:  # the tile's first query sees nothing before its window: skip those tiles
        kv_start = tl.maximum(context_len + tile_q - window + 1, 0) // BLOCK_N * BLOCK_N
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + _NEG_BIG
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_row_ptr = block_tables_ptr + b.to(tl.int64) * stride_bt_b
    for start_n in range(kv_start, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_ptr, v_ptr, table_row_ptr, stride_bt_i, kv_head,
            start_n, kv_end, num_blocks, block_size,
            stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd,
            visible_upto, visible_from, scale_log2,
            k_scale_ptr, v_scale_ptr, stride_ksb, stride_kss, stride_ksh, stride_ksp,
            stride_vsb, stride_vss, stride_vsh, stride_vsp,
            HEAD_DIM, BLOCK_N, BLOCK_D, UPCAST, True, FORMAT,
            k_i8_ptr, k_i4_ptr, v_i8_ptr, v_i4_ptr, ELT, KSUB, WINDOWED)
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    o_off = q_rows * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_off[:, None] + offs_d[None, :].to(tl.int64) * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_out_ptr, part_lse_ptr, block_tables_ptr, seq_lens_ptr,
    scale_log2, num_blocks, block_size, split_len, num_splits, window,
    stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_bt_b, stride_bt_i,
    k_scale_ptr, v_scale_ptr, stride_ksb, stride_kss, stride_ksh, stride_ksp,
    stride_vsb, stride_vss, stride_vsh, stride_vsp,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
    SINGLE_SPLIT: tl.constexpr, FORMAT: tl.constexpr,
    k_i8_ptr, k_i4_ptr, v_i8_ptr, v_i4_ptr, ELT: tl.constexpr, KSUB: tl.constexpr,
    WINDOWED: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * split_len
    # The last split runs to seq_len: an underestimated max_seq_len costs balance, never keys.
    end = tl.where(split == num_splits - 1, seq_len, tl.minimum(start + split_len, seq_len))
    if WINDOWED:  # keys before the window: a split wholly before it reads nothing (lse -inf)
        start = tl.maximum(start, tl.maximum(seq_len - window, 0) // BLOCK_N * BLOCK_N)

    rows = tl.arange(0, BLOCK_G)
    head = kv_head * GROUP + rows
    row_mask = rows < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    io_mask = row_mask[:, None] & d_mask[None, :]
    q_off = b.to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh  # token b: T == B
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :].to(tl.int64) * stride_qd,
                mask=io_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    elif FORMAT == 0:
        q = q.to(k_ptr.dtype.element_ty)

    m_i = tl.zeros([BLOCK_G], dtype=tl.float32) + _NEG_BIG
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    visible_from = tl.zeros([BLOCK_G], dtype=tl.int32) + (seq_len - window)
    table_row_ptr = block_tables_ptr + b.to(tl.int64) * stride_bt_b
    for start_n in range(start, end, BLOCK_N):
        # CAUSAL=False: a decode query sees its whole sequence; m_i stands in for the unused
        # visible_upto argument.
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_ptr, v_ptr, table_row_ptr, stride_bt_i, kv_head,
            start_n, end, num_blocks, block_size,
            stride_kb, stride_ks, stride_kh, stride_kd,
            stride_vb, stride_vs, stride_vh, stride_vd,
            m_i, visible_from, scale_log2,
            k_scale_ptr, v_scale_ptr, stride_ksb, stride_kss, stride_ksh, stride_ksp,
            stride_vsb, stride_vss, stride_vsh, stride_vsp,
            HEAD_DIM, BLOCK_N, BLOCK_D, UPCAST, False, FORMAT,
            k_i8_ptr, k_i4_ptr, v_i8_ptr, v_i4_ptr, ELT, KSUB, WINDOWED)
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    if SINGLE_SPLIT:
        o_off = b.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
        tl.store(out_ptr + o_off[:, None] + offs_d[None, :].to(tl.int64) * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=io_mask)
    else:
        # part_out [B, Hq, num_splits, HEAD_DIM] and part_lse [B, Hq, num_splits], contiguous
        part_row = (b.to(tl.int64) * (tl.num_programs(1) * GROUP) + head) * num_splits + split
        tl.store(part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :], out,
                 mask=io_mask)
        lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=row_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, num_splits,
    stride_ot, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    s_mask = splits < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    part_row = (b.to(tl.int64) * tl.num_programs(1) + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + part_row, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)  # finite: split 0 always holds key 0
    weight = tl.where(lse > float("-inf"), tl.math.exp2(lse - lse_max), 0.0)
    part = tl.load(part_out_ptr + part_row[:, None] * HEAD_DIM + offs_d[None, :],
                   mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(part * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    o_off = b.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_off + offs_d.to(tl.int64) * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, scale: float, *,
                    out: torch.Tensor | None = None, max_seq_len: int | None = None,
                    num_splits: int | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None,
                    window: int | None = None) -> torch.Tensor:
    """Triton paged attention; same contract as ``kernels.reference.paged_attention``
    (``window``: sliding-window attention; the tiles wholly before a query's window are
    skipped, not only masked)."""
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    validate.check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    fmt = validate.check_scales(k_cache, k_scale, v_scale)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.device != q.device:
        raise ValueError(f"out {tuple(out.shape)} must match q {tuple(q.shape)} on {q.device}")
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
    group = num_heads // num_kv_heads
    upcast = _INTERPRET or k_cache.dtype == torch.float32 or q.dtype == torch.float32
    ks, ks_strides = scale_args(fmt, k_cache, k_scale)
    vs, vs_strides = scale_args(fmt, v_cache, v_scale)
    common = dict(
        k_scale_ptr=ks, v_scale_ptr=vs,
        stride_ksb=ks_strides[0], stride_kss=ks_strides[1], stride_ksh=ks_strides[2],
        stride_ksp=ks_strides[3], stride_vsb=vs_strides[0], stride_vss=vs_strides[1],
        stride_vsh=vs_strides[2], stride_vsp=vs_strides[3], FORMAT=FORMAT_IDS[fmt],
        scale_log2=scale * LOG2E, num_blocks=num_blocks, block_size=block_size,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_qd=q.stride(2),
        stride_kb=k_cache.stride(0), stride_ks=k_cache.stride(1),
        stride_kh=k_cache.stride(2), stride_kd=k_cache.stride(3),
        stride_vb=v_cache.stride(0), stride_vs=v_cache.stride(1),
        stride_vh=v_cache.stride(2), stride_vd=v_cache.stride(3),
        stride_ot=out.stride(0), stride_oh=out.stride(1), stride_od=out.stride(2),
        stride_bt_b=block_tables.stride(0), stride_bt_i=block_tables.stride(1),
        HEAD_DIM=head_dim, GROUP=group,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),  # tl.dot needs K >= 16
        UPCAST=upcast,
        k_i8_ptr=k_cache, k_i4_ptr=k_cache, v_i8_ptr=v_cache, v_i4_ptr=v_cache, ELT=1, KSUB=1,
        window=window or 0, WINDOWED=window is not None,
    )
    _launch(q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q, common,
            max_seq_len, num_splits)
    return out


def paged_attention_mixed(q: torch.Tensor, layout, k_arena: torch.Tensor,
                          v_arena: torch.Tensor, k_scales: torch.Tensor,
                          v_scales: torch.Tensor, code_tables: torch.Tensor,
                          seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float, *,
                          out: torch.Tensor | None = None,
                          max_seq_len: int | None = None,
                          num_splits: int | None = None) -> torch.Tensor:
    """Paged attention over a mixed-precision arena (``kernels.mixed_pages``): the table
    holds page codes and each key's format is read in the kernel (FORMAT 4)."""
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.device != q.device:
        raise ValueError(f"out {tuple(out.shape)} must match q {tuple(q.shape)} on {q.device}")
    views_k, views_v = layout.views(k_arena), layout.views(v_arena)
    num_tokens, num_heads, head_dim = q.shape
    num_frames, block_size, num_kv_heads = k_arena.shape[:3]
    upcast = _INTERPRET or layout.dtype == torch.float32 or q.dtype == torch.float32
    sk, sv = k_scales.stride(), v_scales.stride()
    common = dict(
        k_scale_ptr=k_scales, v_scale_ptr=v_scales,
        stride_ksb=sk[0], stride_kss=sk[1], stride_ksh=sk[2], stride_ksp=sk[3],
        stride_vsb=sv[0], stride_vss=sv[1], stride_vsh=sv[2], stride_vsp=sv[3], FORMAT=4,
        scale_log2=scale * LOG2E, num_blocks=num_frames * layout.num_codes,
        block_size=block_size,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_qd=q.stride(2),
        stride_kb=k_arena.stride(0), stride_ks=k_arena.stride(1),
        stride_kh=k_arena.stride(2), stride_kd=1,
        stride_vb=v_arena.stride(0), stride_vs=v_arena.stride(1),
        stride_vh=v_arena.stride(2), stride_vd=1,
        stride_ot=out.stride(0), stride_oh=out.stride(1), stride_od=out.stride(2),
        stride_bt_b=code_tables.stride(0), stride_bt_i=code_tables.stride(1),
        HEAD_DIM=head_dim, GROUP=num_heads // num_kv_heads,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        UPCAST=upcast,
        k_i8_ptr=views_k["int8"], k_i4_ptr=views_k["int4"], v_i8_ptr=views_v["int8"],
        v_i4_ptr=views_v["int4"], ELT=layout.element_size, KSUB=layout.max_subs,
        window=0, WINDOWED=False,
    )
    _launch(q, views_k["full"], views_v["full"], out, code_tables, seq_lens, cu_seqlens_q,
            common, max_seq_len, num_splits)
    return out


def _launch(q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q, common,
            max_seq_len, num_splits) -> None:
    num_tokens, num_seqs = q.shape[0], block_tables.shape[0]
    if num_tokens == num_seqs:  # every q_len == 1 (each sequence has at least one query)
        _decode(q, k_cache, v_cache, out, block_tables, seq_lens, common,
                max_seq_len, num_splits)
    else:
        _prefill(q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q, common)


def _prefill(q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q, common) -> None:
    num_seqs = block_tables.shape[0]
    group = common["GROUP"]
    rows = 16 if _INTERPRET else 64
    block_q = max(1, rows // group)
    block_m = max(16, triton.next_power_of_2(block_q * group))
    block_n = 16 if _INTERPRET else 64
    grid = (q.shape[0] // block_q + num_seqs, k_cache.shape[2])
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q, num_seqs=num_seqs,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_B=triton.next_power_of_2(num_seqs + 1), **common)


def _decode(q, k_cache, v_cache, out, block_tables, seq_lens, common, max_seq_len,
            num_splits) -> None:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    block_n = 16 if _INTERPRET else 64
    if max_seq_len is None:  # the table width bounds every sequence; no device sync
        max_seq_len = block_tables.shape[1] * k_cache.shape[1]
    if num_splits is None:
        num_splits = default_num_splits(q.device, num_seqs, num_kv_heads, max_seq_len, block_n)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    split_len = triton.cdiv(triton.cdiv(max(max_seq_len, 1), num_splits), block_n) * block_n
    single = num_splits == 1
    parts = (num_seqs, num_heads, num_splits)
    part_out = q.new_empty((*parts, head_dim) if not single else (1,), dtype=torch.float32)
    part_lse = q.new_empty(parts if not single else (1,), dtype=torch.float32)
    block_g = max(16, triton.next_power_of_2(common["GROUP"]))
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse, block_tables, seq_lens,
        split_len=split_len, num_splits=num_splits, BLOCK_G=block_g, BLOCK_N=block_n,
        SINGLE_SPLIT=single, **common, **_DECODE_LAUNCH)
    if not single:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_lse, num_splits,
            out.stride(0), out.stride(1), out.stride(2), HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=common["BLOCK_D"])


@contextlib.contextmanager
def decode_launch(**options: int) -> Iterator[None]:
    """Within the block, decode split kernels launch with ``options`` (``num_warps``,
    ``num_stages``): a probe of the launch configuration, not a setting."""
    unknown = set(options) - {"num_warps", "num_stages"}
    if unknown:
        raise ValueError(f"unknown launch options: {sorted(unknown)}")
    saved = dict(_DECODE_LAUNCH)
    _DECODE_LAUNCH.update(options)
    try:
        yield
    finally:
        _DECODE_LAUNCH.clear()
        _DECODE_LAUNCH.update(saved)


def default_num_splits(device: torch.device, num_seqs: int, num_kv_heads: int,
                       max_seq_len: int, block_n: int) -> int:
    """Enough (seq, kv head, split) programs to fill the GPU ~4 times over, but no split
    shorter than 4 key tiles (below that the reduction costs more than it saves)."""
    if device.type == "cuda":
        target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        target = 4  # interpreter: every program costs ~0.5 ms, keep them few
    wanted = math.ceil(target / (num_seqs * num_kv_heads))
    longest_useful = max(1, max_seq_len // (4 * block_n))
    return max(1, min(wanted, longest_useful, 128))
