"""Triton paged attention over block-quantized pages (``kernels.block_quant``: kivi4, k8v4,
kivi2): decode, prefill with cached context and chunked prefill, reading codes, scale
pairs and the residual window in place.

Grid (sequence, KV head, query tile): a tile is BLOCK_Q query tokens x the GROUP query
heads that share the KV head (a decode: one token, its GROUP heads), so each K/V tile is
dequantized once for all of them; a row sees keys <= context_len + its token. Each tile
of BLOCK_N key positions looks up its page per key through the block table, then per key:

- the page's residual row ``slot_of[page]``; a key whose block is still in the residual
  window (row >= 0) is read from it at full precision, every other key from its codes;
- K codes: ``8 / bits`` per byte, element d in bits ``[bits * (d % per), ...)`` of byte
  ``d // per``; their (scale, zero) pair per channel over the block (kivi4: 6-bit codes, two
  channels' pairs in 3 bytes; kivi2: 8-bit codes ``[page, head, d, 2]``) or per token
  (k8v4); V codes always per token with 8-bit pairs;
- scale = table[c] * smax and zero = (z - offset) * zstep with the (block, head)'s fp16
  super pair (smax, zstep); the float32 tables are ``bq.scale_table``'s, loaded, so a
  dequantized element is the same float32 value as ``bq.dequantize_*`` computes.

Softmax runs online in base 2 in float32. Invariants kept by the caller (as
``kernels.cpu_block_decode``): q and out are in the pages' (rotated) basis; the queries'
own K/V are already in the pages; every sequence's length fits its table row and every
used block id is < num_blocks (ids outside it read as zero keys, never out of bounds).
Not split over the context (split-K): one program walks a whole sequence, which fills a
GPU only with enough sequences x KV heads x query tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscope.kernels import block_quant as bq
from kvscope.kernels.triton_attention import _INTERPRET, _NEG_BIG, LOG2E


@triton.jit
def _dequant_tile(codes_ptr, scales_ptr, supers_ptr, table_ptr, page, within, head, offs_d,
                  is_code, dm, stride_cb, stride_cs, stride_ch,
                  stride_sb, stride_ss, stride_sh, stride_sd, stride_pb, stride_ph,
                  BITS: tl.constexpr, PER_CHANNEL: tl.constexpr, PAIR6: tl.constexpr,
                  ZERO_OFFSET: tl.constexpr):
    """[BLOCK_N, BLOCK_D] float32 elements of the keys (or values) ``is_code`` selects, from
    their codes and scale pairs; 0 elsewhere."""
    mask2 = is_code[:, None] & dm[None, :]
    d64 = offs_d.to(tl.int64)
    row = page * stride_cb + within * stride_cs + head * stride_ch
    byte = tl.load(codes_ptr + row[:, None] + (d64 // (8 // BITS))[None, :], mask=mask2, other=0)
    code = (byte.to(tl.int32) >> ((offs_d % (8 // BITS)) * BITS)[None, :]) & ((1 << BITS) - 1)
    sup = supers_ptr + page * stride_pb + head * stride_ph
    smax = tl.load(sup, mask=is_code, other=0.0).to(tl.float32)
    zstep = tl.load(sup + 1, mask=is_code, other=0.0).to(tl.float32)
    if PER_CHANNEL:  # one pair per (block, head, channel)
        base = (page * stride_sb + head * stride_sh)[:, None]
        if PAIR6:  # channels (2j, 2j + 1) in 3 bytes: c_2j, z_2j, c_2j+1, z_2j+1 (6 bits each)
            at = scales_ptr + base + (d64 // 2)[None, :] * stride_sd
            b0 = tl.load(at, mask=mask2, other=0).to(tl.int32)
            b1 = tl.load(at + 1, mask=mask2, other=0).to(tl.int32)
            b2 = tl.load(at + 2, mask=mask2, other=0).to(tl.int32)
            bits = b0 | (b1 << 8) | (b2 << 16)
            shift = ((offs_d % 2) * 12)[None, :]
            c = (bits >> shift) & 63
            z = (bits >> (shift + 6)) & 63
        else:
            at = scales_ptr + base + d64[None, :] * stride_sd
            c = tl.load(at, mask=mask2, other=0).to(tl.int32)
            z = tl.load(at + 1, mask=mask2, other=0).to(tl.int32)
        scale = tl.load(table_ptr + c) * smax[:, None]
        zero = (z - ZERO_OFFSET).to(tl.float32) * zstep[:, None]
    else:  # one pair per (block, token, head)
        at = scales_ptr + page * stride_sb + within * stride_ss + head * stride_sh
        c = tl.load(at, mask=is_code, other=0).to(tl.int32)
        z = tl.load(at + 1, mask=is_code, other=0).to(tl.int32)
        scale = (tl.load(table_ptr + c) * smax)[:, None]
        zero = ((z - ZERO_OFFSET).to(tl.float32) * zstep)[:, None]
    return tl.where(mask2, code.to(tl.float32) * scale + zero, 0.0)


@triton.jit
def _block_attention_kernel(
    q_ptr, out_ptr, tables_ptr, lens_ptr, cu_ptr, slot_ptr, scale_log2, num_blocks,
    block_size,
    kc_ptr, ks_ptr, kp_ptr, k_table_ptr, vc_ptr, vs_ptr, vp_ptr, v_table_ptr, rk_ptr, rv_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_tb, stride_ti,
    stride_kcb, stride_kcs, stride_kch, stride_ksb, stride_kss, stride_ksh, stride_ksd,
    stride_kpb, stride_kph,
    stride_vcb, stride_vcs, stride_vch, stride_vsb, stride_vss, stride_vsh,
    stride_vpb, stride_vph, stride_rb, stride_rs, stride_rh,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    K_PER_CHANNEL: tl.constexpr, K_PAIR6: tl.constexpr, K_ZERO: tl.constexpr,
    V_ZERO: tl.constexpr,
):
    """Grid (sequence, KV head, query tile): BLOCK_Q query tokens x GROUP heads = the rows;
    a row sees keys <= context_len + its token (a decode: its whole sequence)."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile_q = tl.program_id(2) * BLOCK_Q
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    if tile_q >= q_len:
        return
    head64 = kv_head.to(tl.int64)
    seq_len = tl.load(lens_ptr + b)
    context_len = seq_len - q_len
    rows = tl.arange(0, BLOCK_M)
    token = tile_q + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < BLOCK_Q * GROUP) & (token < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    dm = offs_d < HEAD_DIM
    io_mask = row_mask[:, None] & dm[None, :]
    q_rows = (q_start + token).to(tl.int64)
    q_off = q_rows * stride_qt + heads.to(tl.int64) * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=io_mask, other=0.0)
    q = q.to(tl.float32)
    visible_upto = context_len + token  # inclusive
    kv_end = context_len + tl.minimum(tile_q + BLOCK_Q, q_len)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + _NEG_BIG
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    table_row = tables_ptr + b.to(tl.int64) * stride_tb
    for start_n in range(0, kv_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        in_range = offs_n < kv_end
        page = tl.load(table_row + (offs_n // block_size).to(tl.int64) * stride_ti,
                       mask=in_range, other=0)
        valid = in_range & (page >= 0) & (page < num_blocks)
        page = tl.where(valid, page, 0).to(tl.int64)
        within = (offs_n % block_size).to(tl.int64)
        slot = tl.load(slot_ptr + page, mask=valid, other=-1)
        is_res = valid & (slot >= 0)
        is_code = valid & (slot < 0)
        res_row = tl.where(is_res, slot, 0).to(tl.int64) * stride_rb + within * stride_rs + \
            head64 * stride_rh
        res_ptrs = res_row[:, None] + offs_d[None, :].to(tl.int64)
        res_mask = is_res[:, None] & dm[None, :]
        k = _dequant_tile(kc_ptr, ks_ptr, kp_ptr, k_table_ptr, page, within, head64, offs_d,
                          is_code, dm, stride_kcb, stride_kcs, stride_kch,
                          stride_ksb, stride_kss, stride_ksh, stride_ksd, stride_kpb,
                          stride_kph, KBITS, K_PER_CHANNEL, K_PAIR6, K_ZERO)
        k += tl.load(rk_ptr + res_ptrs, mask=res_mask, other=0.0).to(tl.float32)
        v = _dequant_tile(vc_ptr, vs_ptr, vp_ptr, v_table_ptr, page, within, head64, offs_d,
                          is_code, dm, stride_vcb, stride_vcs, stride_vch,
                          stride_vsb, stride_vss, stride_vsh, 0, stride_vpb,
                          stride_vph, VBITS, False, False, V_ZERO)
        v += tl.load(rv_ptr + res_ptrs, mask=res_mask, other=0.0).to(tl.float32)
        if UPCAST:  # interpreter or float32 q: exact float32 products
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q.to(q_ptr.dtype.element_ty),
                       tl.trans(k.to(q_ptr.dtype.element_ty))).to(tl.float32)
        keep = in_range[None, :] & (offs_n[None, :] <= visible_upto[:, None])
        s = tl.where(keep, s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if UPCAST:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(q_ptr.dtype.element_ty),
                        v.to(q_ptr.dtype.element_ty)).to(tl.float32)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    o_off = q_rows * stride_ot + heads.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_off[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=io_mask)


def supports(q: torch.Tensor, pages: bq.BlockLayer) -> bool:
    """CUDA queries and pages on one device, every page tensor contiguous (the kernel
    computes element offsets from their strides with a unit last stride)."""
    tensors = (*pages.key_tensors, *pages.value_tensors, pages.residual_k, pages.residual_v,
               pages.slot_of)
    return q.device.type == "cuda" and all(t.device == q.device and t.is_contiguous()
                                           for t in tensors)


_TABLES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _table(pair_bits: int, device: torch.device) -> torch.Tensor:
    key = (pair_bits, device)
    if key not in _TABLES:
        _TABLES[key] = bq.scale_table(pair_bits).to(device)
    return _TABLES[key]


def block_decode(q: torch.Tensor, pages: bq.BlockLayer, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence: q ``[S, Hq, D]`` (pages' basis) -> ``[S, Hq, D]`` in
    q's dtype, attending over each sequence's ``seq_lens`` keys in its ``block_tables`` row
    (same contract as ``kernels.cpu_block_decode.block_decode`` without ``model_basis``)."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int64, device=q.device)
    return block_attention(q, pages, block_tables, seq_lens, cu, scale, max_q_len=1)


def block_attention(q: torch.Tensor, pages: bq.BlockLayer, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, scale: float, *,
                    max_q_len: int | None = None) -> torch.Tensor:
    """Causal paged attention of ``q [T, Hq, D]`` (pages' basis; sequence b's queries are
    rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]``, its last ones: prefill with cached
    context, chunked prefill and decode alike) over the block-quantized ``pages``; the
    queries' own K/V must already be in the pages (the residual window). ``max_q_len``:
    the longest q_len, else read from ``cu_seqlens_q`` (one device sync)."""
    fmt = pages.fmt
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = block_tables.shape[0]
    if q.stride(2) != 1:
        q = q.contiguous()
    if seq_lens.shape[0] != num_seqs or cu_seqlens_q.shape[0] != num_seqs + 1:
        raise ValueError(f"block_tables {tuple(block_tables.shape)}, seq_lens "
                         f"{tuple(seq_lens.shape)}, cu_seqlens_q {tuple(cu_seqlens_q.shape)}")
    hkv = pages.num_kv_heads
    if num_heads % hkv:
        raise ValueError(f"{num_heads} query heads over {hkv} KV heads")
    out = torch.empty_like(q)
    if num_seqs == 0 or num_tokens == 0:
        return out
    if max_q_len is None:
        max_q_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    group = num_heads // hkv
    rows = 16 if _INTERPRET else 64
    block_q = 1 if max_q_len == 1 else max(1, rows // group)
    ks, kc, kp = pages.k_scales, pages.k_codes, pages.k_supers
    vs, vc, vp = pages.v_scales, pages.v_codes, pages.v_supers
    rk = pages.residual_k
    # per-channel scale pairs [n, Hkv, D(/2), 2|3]; per-token [n, T, Hkv, 2] (stride_ss used)
    ks_strides = (ks.stride(0), 0, ks.stride(1), ks.stride(2)) if fmt.keys_per_channel else \
        (ks.stride(0), ks.stride(1), ks.stride(2), 0)
    upcast = _INTERPRET or q.dtype == torch.float32
    grid = (num_seqs, hkv, triton.cdiv(max_q_len, block_q))
    _block_attention_kernel[grid](
        q, out, block_tables, seq_lens, cu_seqlens_q, pages.slot_of, scale * LOG2E,
        pages.num_blocks, pages.block_size, kc, ks, kp, _table(fmt.key_pair_bits, q.device),
        vc, vs, vp, _table(8, q.device), rk, pages.residual_v,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), block_tables.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), *ks_strides, kp.stride(0), kp.stride(1),
        vc.stride(0), vc.stride(1), vc.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
        vp.stride(0), vp.stride(1), rk.stride(0), rk.stride(1), rk.stride(2),
        HEAD_DIM=head_dim, GROUP=group, BLOCK_Q=block_q,
        BLOCK_M=max(16, triton.next_power_of_2(block_q * group)),
        BLOCK_N=16 if _INTERPRET else 64, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        UPCAST=upcast, KBITS=fmt.key_bits, VBITS=fmt.value_bits,
        K_PER_CHANNEL=fmt.keys_per_channel, K_PAIR6=fmt.key_pair_bits == 6,
        K_ZERO=bq.zero_offset(fmt.key_pair_bits), V_ZERO=bq.zero_offset(8))
    return out
