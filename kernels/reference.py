"""Pure-torch versions of the paged-cache kernels: the engine's CPU path, and what the
Triton kernels are tested against.

Cache layout per layer: K and V ``[num_blocks, block_size, num_kv_heads, head_dim]`` (NHD).
A token's slot is ``block * block_size + offset``; slot -1 marks a padding token.

These run the engine on CPU (30 layers x 32 concurrent sequences), so they are vectorised:
decode gathers the sequences' pages with one index_select per cache per length group and
runs SDPA; only prefill segments (q_len > 1) loop, once per sequence (SDPA, causal).
Unlike the Triton kernels they read tensor values to validate them (cheap on CPU) and
raise ValueError before writing anything.

Quantized pages (``kernels.quant``): the format follows from the cache dtype; scales are
keyword-only ``k_scale``/``v_scale`` (fp8: per-head [Hkv]; int8/int4: per-token pages
[num_blocks, block_size, Hkv, P]). ``reshape_and_cache`` quantizes as it writes;
``paged_attention`` dequantizes only the pages it gathers, never the whole cache. The
positional argument lists here are the stable interface.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvscope.kernels import quant, validate


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                      k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> None:
    """Write key/value ``[T, Hkv, D]`` into the pages at ``slot_mapping[T]``, in place.

    Slots < 0 are padding and skipped. Values are cast to the cache dtype, or quantized
    for fp8/int8/int4 pages (int8/int4 also write each token's scales into ``k_scale``/
    ``v_scale`` at the same slot). Two tokens must not share a slot (which one wins would
    be unspecified).
    """
    validate.check_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
    fmt = validate.check_scales(k_cache, k_scale, v_scale)
    num_blocks, block_size = k_cache.shape[:2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    validate.check_index_range("slot_mapping", slots, num_blocks * block_size)
    # One index_put per cache through the (block, offset) pair: valid for any cache strides,
    # unlike a flattened view, which would silently copy a non-contiguous cache.
    index = (slots // block_size, slots % block_size)
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        x = x[keep]
        if fmt == "auto":
            cache.index_put_(index, x.to(cache.dtype))
        elif fmt == "fp8":
            cache.index_put_(index, quant.quantize_fp8(x, scale))
        else:
            codes, scales = quant.quantize(x, fmt)
            cache.index_put_(index, codes)
            scale.index_put_(index, scales)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, scale: float, *,
                    out: torch.Tensor | None = None, max_seq_len: int | None = None,
                    num_splits: int | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None,
                    window: int | None = None) -> torch.Tensor:
    """Causal attention of ``q [T, Hq, D]`` over each sequence's paged K/V.

    Sequence b owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (q_len >= 1), the last
    q_len of its ``seq_lens[b]`` tokens; its keys live in pages ``block_tables[b, :]``.
    Query i of b sees key positions < context_len + i + 1, context_len = seq_len - q_len.
    Query head h reads KV head h // (Hq // Hkv). Softmax in fp32; returns q's dtype (written
    into ``out`` when given). ``max_seq_len`` and ``num_splits`` only tune the Triton
    backend; they are accepted here so both backends share one signature. Quantized pages
    are dequantized (with ``k_scale``/``v_scale``) as they are gathered. ``window`` W
    (sliding-window attention): query i also sees only the last W positions, keys
    > context_len + i - W; pages wholly before that may hold anything (they are not read
    for their values' sake: the mask hides them).
    """
    del max_seq_len, num_splits
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    validate.check_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    validate.check_scales(k_cache, k_scale, v_scale)
    kv = _Pages(k_cache, v_cache, k_scale, v_scale)
    return attend_pages(q, kv, block_tables, seq_lens, cu_seqlens_q, scale, out, window)


def attend_pages(q: torch.Tensor, kv, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 cu_seqlens_q: torch.Tensor, scale: float,
                 out: torch.Tensor | None, window: int | None = None) -> torch.Tensor:
    """``paged_attention`` over any page store ``kv`` with ``num_blocks``, ``block_size``,
    ``num_kv_heads``, ``compute_dtype(q)`` and ``gather(pages, dtype) -> K, V`` (``_Pages``
    here, ``kernels.mixed_pages.MixedPages`` for pools of several formats)."""
    num_blocks, block_size = kv.num_blocks, kv.block_size
    cu = cu_seqlens_q.long()
    lens = seq_lens.long()
    q_lens = cu[1:] - cu[:-1]
    _check_lengths(q, cu, q_lens, lens, block_tables, block_size, num_blocks)
    result = torch.empty_like(q) if out is None else out
    if out is not None and (out.shape != q.shape or out.device != q.device):
        raise ValueError(f"out {tuple(out.shape)} on {out.device} must match q "
                         f"{tuple(q.shape)} on {q.device}")

    is_decode = q_lens == 1
    if bool(is_decode.all()):  # pure decode batch: row b is token b
        result.copy_(_decode(q, kv, block_tables, lens, scale, window))
        return result
    decode_rows = is_decode.nonzero().flatten()
    if decode_rows.numel():
        tokens = cu[decode_rows]
        result[tokens] = _decode(q[tokens], kv, block_tables[decode_rows],
                                 lens[decode_rows], scale, window).to(result.dtype)
    for b in (~is_decode).nonzero().flatten().tolist():
        start, end = int(cu[b]), int(cu[b + 1])
        result[start:end] = _prefill_one(q[start:end], kv, block_tables[b],
                                         int(lens[b]), scale, window).to(result.dtype)
    return result


def _check_lengths(q: torch.Tensor, cu: torch.Tensor, q_lens: torch.Tensor, lens: torch.Tensor,
                   block_tables: torch.Tensor, block_size: int, num_blocks: int) -> None:
    if int(cu[0]) != 0 or int(cu[-1]) != q.shape[0]:
        raise ValueError(f"cu_seqlens_q must run from 0 to T={q.shape[0]}, "
                         f"got {int(cu[0])}..{int(cu[-1])}")
    if bool((q_lens < 1).any()):
        raise ValueError(f"every sequence needs q_len >= 1, got q_lens {q_lens.tolist()}")
    if bool((lens < q_lens).any()):
        raise ValueError(f"seq_lens {lens.tolist()} shorter than q_lens {q_lens.tolist()}")
    pages = (lens + block_size - 1) // block_size
    if int(pages.max()) > block_tables.shape[1]:
        raise ValueError(f"a sequence needs {int(pages.max())} pages but block_tables has "
                         f"{block_tables.shape[1]} columns")
    used = torch.arange(block_tables.shape[1], device=lens.device)[None, :] < pages[:, None]
    validate.check_index_range("block_tables", block_tables[used], num_blocks)


class _Pages:
    """One layer's K/V pages with their scales; ``gather`` dequantizes selected pages."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
        self.k_cache, self.v_cache, self.k_scale, self.v_scale = k_cache, v_cache, k_scale, v_scale
        self.format = quant.format_of(k_cache)
        self.per_token = quant.scale_params(self.format) > 0
        self.num_blocks, self.block_size, self.num_kv_heads = k_cache.shape[:3]

    def compute_dtype(self, q: torch.Tensor) -> torch.dtype:
        return _compute_dtype(self.k_cache, q)

    def gather(self, pages: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Pages ``[n]`` -> K, V ``[n, block_size, Hkv, D]`` in ``dtype``."""
        out = []
        for cache, scale in ((self.k_cache, self.k_scale), (self.v_cache, self.v_scale)):
            codes = cache.index_select(0, pages)
            if self.per_token:
                scale = scale.index_select(0, pages)
            out.append(quant.dequantize(codes, scale, self.format, dtype))
        return out[0], out[1]


# Decode sequences per attention call: sorted by length and cut into groups of this many,
# each padded only to its own longest (one call pads a mixed batch to its longest; with
# prompts of 10..450 tokens that doubled the keys read).
_DECODE_GROUP = 8


def window_mask(query_pos: torch.Tensor, num_keys: int, window: int | None) -> torch.Tensor:
    """[..., num_keys] bool: key j visible from a query at ``query_pos`` [...] (causal, and
    within the last ``window`` positions when windowed)."""
    keys = torch.arange(num_keys, device=query_pos.device)
    visible = keys <= query_pos[..., None]
    if window is not None:
        visible &= keys > query_pos[..., None] - window
    return visible


def _decode(q: torch.Tensor, kv: _Pages, block_tables: torch.Tensor, lens: torch.Tensor,
            scale: float, window: int | None = None) -> torch.Tensor:
    """One query per sequence: q [n, Hq, D]; one gather per cache per length group, then
    SDPA with a length mask (GQA via ``enable_gqa``: head h reads KV head h // G).

    SDPA's fused CPU kernel (fp32 accumulation, also for bf16 pages) measured 2x faster
    than explicit batched matmuls in fp32 and 3-4x in bf16 on 2 cores (docs/BENCHMARKS.md).
    """
    n, num_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads = kv.num_blocks, kv.block_size, kv.num_kv_heads
    dtype = kv.compute_dtype(q)
    out = torch.empty(n, num_heads, head_dim, dtype=dtype, device=q.device)
    order = torch.argsort(lens)
    for lo in range(0, n, _DECODE_GROUP):
        rows = order[lo:lo + _DECODE_GROUP]
        group_lens = lens[rows]
        max_len = int(group_lens.max())
        # Pages past a sequence's end may hold any id (padding); clamp so the gather stays
        # in range, the length mask hides them.
        pages = block_tables[rows, : (max_len + block_size - 1) // block_size].long()
        k, v = kv.gather(pages.clamp(0, num_blocks - 1).flatten(), dtype)
        k = k.view(rows.numel(), -1, num_kv_heads, head_dim).transpose(1, 2)  # [m, Hkv, L, D]
        v = v.view(rows.numel(), -1, num_kv_heads, head_dim).transpose(1, 2)
        visible = window_mask(group_lens - 1, k.shape[2], window)
        # Slots past a sequence's end hold whatever the page held before (in a mixed arena,
        # a reused frame's old quantized bytes, which read as fp32 can be NaN or inf): the
        # mask alone would let them through (NaN + -inf, 0 x NaN), so they are zeroed.
        hide = ~visible[:, None, :, None]
        k, v = k.masked_fill(hide, 0), v.masked_fill(hide, 0)
        o = F.scaled_dot_product_attention(
            q[rows].to(dtype).unsqueeze(2), k, v, attn_mask=visible[:, None, None, :],
            scale=scale, enable_gqa=True)
        out[rows] = o.squeeze(2)
    return out


def _prefill_one(q: torch.Tensor, kv: _Pages, table: torch.Tensor, seq_len: int,
                 scale: float, window: int | None = None) -> torch.Tensor:
    """One sequence's q_len > 1 queries [q_len, Hq, D] against its first seq_len keys.

    SDPA's fused kernel (it never holds the whole [Hq, q_len, seq_len] score matrix):
    ``is_causal`` when there is no cached context, else a mask with the causal rule
    offset by the context. Measured 2.8x (fp32) to 8x (bf16) faster than explicit
    batched matmuls on 2 CPU cores, 2,000-token prompt (docs/BENCHMARKS.md).
    """
    q_len = q.shape[0]
    block_size = kv.block_size
    pages = table[: (seq_len + block_size - 1) // block_size].long()
    dtype = kv.compute_dtype(q)
    k, v = kv.gather(pages, dtype)
    k = k.flatten(0, 1)[:seq_len].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
    v = v.flatten(0, 1)[:seq_len].transpose(0, 1).unsqueeze(0)
    qh = q.to(dtype).transpose(0, 1).unsqueeze(0)  # [1, Hq, q_len, D]
    context_len = seq_len - q_len
    if context_len == 0 and window is None:
        o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale,
                                           enable_gqa=True)
    else:  # query i sees keys < context_len + i + 1 (and > context_len + i - window)
        visible = window_mask(torch.arange(q_len, device=q.device) + context_len, seq_len,
                              window)
        o = F.scaled_dot_product_attention(qh, k, v, attn_mask=visible, scale=scale,
                                           enable_gqa=True)
    return o[0].transpose(0, 1)


def _compute_dtype(cache: torch.Tensor, q: torch.Tensor) -> torch.dtype:
    """The wider of the page and query dtypes (fp32 accumulation inside), or q's dtype for
    quantized pages (dequantized into it). bf16 on CPU runs on AMX/AVX512-BF16 where the
    CPU has them."""
    if quant.format_of(cache) == "auto":
        return torch.promote_types(cache.dtype, q.dtype)
    return q.dtype


def copy_blocks(k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                block_mapping: torch.Tensor, *, k_scales: list[torch.Tensor] | None = None,
                v_scales: list[torch.Tensor] | None = None) -> None:
    """Copy page ``src`` to page ``dst`` for each row of ``block_mapping [N, 2]``, every layer.

    int8/int4 pages need their per-token scale tensors (one per layer) in ``k_scales``/
    ``v_scales``: a page is copied with its scales. All sources are read before any
    destination is written (a snapshot), which is what the Triton kernel computes too as
    long as no dst is also a src (true for copy-on-write: dst pages are freshly allocated).
    """
    tensors = validate.check_copy_blocks(k_caches, v_caches, block_mapping, k_scales, v_scales)
    if block_mapping.numel() == 0:
        return
    for cache in tensors:
        validate.check_index_range("block_mapping", block_mapping, cache.shape[0])
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    for cache in tensors:
        pages = raw(cache)
        pages.index_copy_(0, dst, pages.index_select(0, src))


def raw(t: torch.Tensor) -> torch.Tensor:
    """fp8 pages as bytes: torch has no CPU index_copy_ for float8 (copying is dtype-blind)."""
    return t.view(torch.uint8) if t.dtype == quant.FP8_DTYPE else t


def checked_swap_mapping(src: torch.Tensor, dst: torch.Tensor,
                         block_mapping: torch.Tensor) -> torch.Tensor | None:
    """``swap_blocks``' checks: the mapping as int64 on the host, or None when it is empty."""
    validate.check_block_mapping(block_mapping)
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(f"src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} "
                         f"{dst.dtype} must have the same page shape and dtype")
    if block_mapping.numel() == 0:
        return None
    mapping = block_mapping.cpu().long()
    validate.check_index_range("block_mapping[:, 0]", mapping[:, 0], src.shape[0])
    validate.check_index_range("block_mapping[:, 1]", mapping[:, 1], dst.shape[0])
    return mapping


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy pages ``src[m[i, 0]]`` -> ``dst[m[i, 1]]`` across devices (GPU <-> CPU) or within one.

    Batched: one gather on the source device, one transfer, one scatter on the destination;
    never one copy per block. Host staging is pinned when the destination is a GPU so the
    upload runs at full PCIe/NVLink speed. Call once per cache tensor (K and V of a layer),
    and once per per-token scale tensor of int8/int4 pages: scales travel with the block.
    """
    mapping = checked_swap_mapping(src, dst, block_mapping)
    if mapping is None:
        return
    src_idx = mapping[:, 0].to(src.device)
    dst_idx = mapping[:, 1].to(dst.device)
    src, dst = raw(src), raw(dst)
    if src.device.type == "cpu" and dst.device.type == "cuda":
        staged = torch.empty((len(mapping), *src.shape[1:]), dtype=src.dtype, pin_memory=True)
        torch.index_select(src, 0, src_idx, out=staged)
        dst.index_copy_(0, dst_idx, staged.to(dst.device, non_blocking=True))
    else:
        dst.index_copy_(0, dst_idx, src.index_select(0, src_idx).to(dst.device))
