"""The engine's CPU paged attention: everything that depends only on the step's batch
(slot indices, decode length groups, page lists, masks, validation) is computed ONCE per
step in a ``StepPlan``; each layer then only writes its K/V and gathers/attends with those
precomputed indices: no host syncs, no ``.item()``/``.tolist()``/``nonzero`` and no
data-dependent shapes inside the layer loop.

Same semantics and cache layout as ``kernels.reference`` (which stays the pure-torch
reference the Triton kernels are tested against; its docstring defines the arguments).
Differences, all for speed on CPU:
  * attention computes in float32 for every page format (bf16/fp16 pages and quantized
    pages are widened as they are gathered); the output is cast to q's dtype. On a CPU
    without AMX, SDPA in bf16 measured 2-4x slower than in fp32 for decode;
  * decode reads float32/bfloat16 pages in place with the native kernel
    (kernels/cpu_paged_decode.c via kernels/cpu_native.py: no gathered or widened copy of
    the cache, fp32 accumulation); a pure decode step into pages of the K/V dtype is one
    native call per layer that also writes the new K/V rows and returns q's dtype; other
    pages, or no C compiler, take the torch path: the
    decode length groups' page lists, query rows and masks built once per step, per layer
    one index_select of the decode queries and one gather per group;
  * prefills read their keys from the pages in place with the native prefill kernel
    (kernels/cpu_paged_prefill.c: flash-attention tiles, float32 accumulation, bfloat16 dot
    products where the CPU has them) when q and the pages share a dtype the build supports,
    writing q's dtype; otherwise torch's SDPA over the given or gathered K/V in float32;
  * K/V are written with ``index_copy_`` through a flat slot view of a contiguous cache
    (``index_put_`` with a (block, offset) pair otherwise, as the reference);
  * a prefill with no cached context attends over the K/V it was given rather than
    reading them back from the pages, when the pages hold exactly those values (page
    dtype = K/V dtype, no padding slot in the step).

A rejected step raises ValueError before layer 0 writes anything.

Sliding-window layers (``forward(..., window=W)``): decodes take the native decode kernel
with the window (it reads only the pages from the one holding the window's first key: at
most W / block_size + 1 of them, whatever the sequence's length), fused with the K/V write
as above; prefills take the native prefill kernel with the window where it serves the
pages (it skips the key blocks wholly before a query tile's window). On the torch path a
decode gathers only the window's pages, with masks that also hide keys before the window
(built once per step and window), and a prefill uses window masks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvscope.kernels import cpu_native, quant, reference, validate

# Decode sequences per SDPA call: sorted by length and cut into groups, each padded only to
# its own longest (as kernels.reference._decode, which measured why).
DECODE_GROUP = 8
COMPUTE_DTYPE = torch.float32


@dataclass
class _DecodeGroup:
    first: int  # this group's sequences are rows first:first+num_seqs of the sorted decodes
    page_lo: int  # its pages are page_lo:page_hi of the step's gathered decode pages
    page_hi: int
    visible: torch.Tensor  # [m, 1, 1, P * block_size] bool: key j < seq_len
    num_seqs: int
    lens: torch.Tensor  # [m] int64: the group's sequence lengths


@dataclass
class _PrefillSeq:
    start: int  # query rows start:end
    end: int
    seq_len: int
    pages: torch.Tensor  # [ceil(seq_len / block_size)] int64
    visible: torch.Tensor | None  # [q_len, seq_len] bool, None: plain causal (no context)


class StepPlan:
    """One step's attention metadata for a paged cache of ``num_blocks`` x ``block_size``.

    Build it once per step (the lengths and ranges are validated here, raising ValueError),
    then call ``forward`` once per layer: write the layer's K/V into their slots and attend.
    Arguments as ``kernels.reference``'s ``reshape_and_cache`` / ``paged_attention``; CPU
    tensors."""

    def __init__(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, block_size: int,
                 num_blocks: int) -> None:
        self.slot_mapping, self.block_tables = slot_mapping, block_tables
        self.seq_lens, self.cu_seqlens_q = seq_lens, cu_seqlens_q
        self.block_size, self.num_blocks = block_size, num_blocks
        self.shapes_checked = False
        num_tokens = slot_mapping.shape[0]
        if slot_mapping.dim() != 1 or block_tables.dim() != 2 or \
                seq_lens.shape != (block_tables.shape[0],) or \
                cu_seqlens_q.shape != (block_tables.shape[0] + 1,) or block_tables.shape[0] == 0:
            raise ValueError(f"inconsistent step batch: slot_mapping {tuple(slot_mapping.shape)}, "
                             f"block_tables {tuple(block_tables.shape)}, seq_lens "
                             f"{tuple(seq_lens.shape)}, cu_seqlens_q {tuple(cu_seqlens_q.shape)}")
        cu, lens = cu_seqlens_q.long(), seq_lens.long()
        q_lens = cu[1:] - cu[:-1]
        reference._check_lengths(torch.empty(num_tokens, 0), cu, q_lens, lens, block_tables,
                                 block_size, num_blocks)

        slots = slot_mapping.long()
        keep = slots >= 0
        self.keep = None if bool(keep.all()) else keep.nonzero().flatten()
        valid = slots if self.keep is None else slots[keep]
        validate.check_index_range("slot_mapping", valid, num_blocks * block_size)
        self.write_index = (valid // block_size, valid % block_size)
        self.write_slots = valid.contiguous()

        decode = (q_lens == 1).nonzero().flatten()
        self.decode_only = decode.numel() == q_lens.numel()
        # The decodes in row order, as the native kernel (kernels/cpu_native.py) reads them:
        # every decode's pages in place, no sorting, groups or gathers.
        tables = block_tables.long()
        self.native_rows = cu[decode]
        self.native_tables = tables[decode].contiguous()
        self.native_lens = lens[decode].contiguous()
        self.prefills: list[_PrefillSeq] = []
        prefill_rows = (q_lens != 1).nonzero().flatten()
        # the native prefill kernel's view of them (none in a pure decode step): (first query
        # row, query rows, keys) as three contiguous rows, and their block tables; whether
        # the kernel takes them is decided on the first layer's tensors (same for every layer)
        self.native_prefill: bool | None = None
        if prefill_rows.numel():
            self.native_prefill_spans = torch.stack([cu[prefill_rows], q_lens[prefill_rows],
                                                     lens[prefill_rows]]).contiguous()
            self.native_prefill_tables = tables[prefill_rows].contiguous()
        for b in prefill_rows.tolist():
            start, end, seq_len = int(cu[b]), int(cu[b + 1]), int(lens[b])
            q_len, context = end - start, seq_len - (end - start)
            pages = tables[b, : (seq_len + block_size - 1) // block_size]
            visible = None
            if context > 0:  # query i sees keys < context + i + 1
                visible = torch.arange(seq_len)[None, :] <= torch.arange(q_len)[:, None] + context
            self.prefills.append(_PrefillSeq(start, end, seq_len, pages, visible))

    @functools.cached_property
    def _torch_decode(self) -> tuple[list[_DecodeGroup], torch.Tensor, torch.Tensor,
                                     torch.Tensor | None]:
        """The torch path's decode metadata (groups, their concatenated pages, query rows in
        group order, the unsort of a pure-decode batch), built on first use: a step whose
        pages the native kernel reads never pays for it."""
        lens, bs, nb = self.native_lens, self.block_size, self.num_blocks
        order = torch.argsort(lens, stable=True)  # positions among the decodes
        groups: list[_DecodeGroup] = []
        group_pages: list[torch.Tensor] = []
        page_lo = 0
        for lo in range(0, order.numel(), DECODE_GROUP):
            seqs = order[lo:lo + DECODE_GROUP]
            group_lens = lens[seqs]
            num_pages = (int(group_lens.max()) + bs - 1) // bs
            group_pages.append(self.native_tables[seqs, :num_pages].clamp(0, nb - 1).flatten())
            keys = torch.arange(num_pages * bs)
            visible = (keys[None, :] < group_lens[:, None])[:, None, None, :]
            page_hi = page_lo + group_pages[-1].numel()
            groups.append(_DecodeGroup(first=lo, page_lo=page_lo, page_hi=page_hi,
                                       visible=visible, num_seqs=seqs.numel(),
                                       lens=group_lens))
            page_lo = page_hi
        rows = self.native_rows[order]  # query rows of the decodes, in group order
        # a pure decode batch: the sorted outputs, put back in row order, are the result
        unsort = torch.argsort(rows) if self.decode_only else None
        # every group's pages, concatenated (clamped: the masks hide extras)
        return groups, torch.cat(group_pages), rows, unsort

    def _window_decode(self, window: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """For a ``window``-token sliding window on the torch path: each decode group's
        (pages, mask), the pages from the first one holding a visible key; built on first
        use and kept for the step (every windowed layer shares them)."""
        cache = self.__dict__.setdefault("_window_decodes", {})
        if window not in cache:
            groups = self._torch_decode[0] if self.native_rows.numel() else []
            order = torch.argsort(self.native_lens, stable=True)  # as _torch_decode's
            bs, tables = self.block_size, self.native_tables
            decode = []
            for g in groups:
                seqs = order[g.first:g.first + g.num_seqs]
                lens = self.native_lens[seqs]
                first = (lens - window).clamp(min=0) // bs  # page of the first visible key
                num_pages = int(((lens + bs - 1) // bs - first).max())
                # columns past a sequence's pages hold keys past its end: clamped, masked
                cols = (first[:, None] + torch.arange(num_pages)).clamp(max=tables.shape[1] - 1)
                pages = tables[seqs[:, None], cols].clamp(0, self.num_blocks - 1).flatten()
                keys = first[:, None] * bs + torch.arange(num_pages * bs)
                last = (lens - 1)[:, None]
                mask = (keys <= last) & (keys > last - window)
                decode.append((pages, mask[:, None, None, :]))
            cache[window] = decode
        return cache[window]

    def _window_prefill(self, window: int) -> list[torch.Tensor]:
        """Each prefill's [q_len, seq_len] mask for a ``window``-token sliding window; built
        on first use and kept for the step."""
        cache = self.__dict__.setdefault("_window_prefills", {})
        if window not in cache:
            cache[window] = [reference.window_mask(torch.arange(p.end - p.start) + p.seq_len
                                                   - (p.end - p.start), p.seq_len, window)
                             for p in self.prefills]
        return cache[window]

    def _check_shapes(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
        """The reference's shape/dtype/device checks, on the first layer's tensors."""
        validate.check_reshape_and_cache(k, v, k_cache, v_cache, self.slot_mapping)
        validate.check_scales(k_cache, k_scale, v_scale)
        validate.check_paged_attention(q, k_cache, v_cache, self.block_tables, self.seq_lens,
                                       self.cu_seqlens_q)
        if tuple(k_cache.shape[:2]) != (self.num_blocks, self.block_size):
            raise ValueError(f"cache has {tuple(k_cache.shape[:2])} (blocks, block size), the "
                             f"plan was built for {(self.num_blocks, self.block_size)}")
        self.shapes_checked = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float, *,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                window: int | None = None) -> torch.Tensor:
        """One layer: ``reshape_and_cache(k, v, ...)`` then ``paged_attention(q, ...)``
        (``window``: a sliding-window layer's W); returns [T, Hq, D] in q's dtype."""
        if not self.shapes_checked:
            self._check_shapes(q, k, v, k_cache, v_cache, k_scale, v_scale)
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if self._fused_decode(q, k, v, k_cache, v_cache, k_scale):
            # one native call writes the step's K/V rows and attends, reading q, k and v
            # where they lie (views into the fused qkv) and returning q's dtype
            return cpu_native.paged_decode(q, k_cache, v_cache, self.native_tables,
                                           self.native_lens, scale,
                                           new_kv=(k, v, self.write_slots), out_dtype=q.dtype,
                                           window=window)
        self._write(k, v, k_cache, v_cache, k_scale, v_scale)
        # fresh prefills may use k/v as given when the pages hold exactly these values
        given = (k, v) if window is None and self.keep is None and \
            k_cache.dtype == k.dtype and v_cache.dtype == v.dtype else None
        return self._attend(q, reference._Pages(k_cache, v_cache, k_scale, v_scale), scale,
                            given, window)

    def _fused_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      k_scale: torch.Tensor | None) -> bool:
        """A pure decode step into plain float32/bfloat16 pages of the K/V dtype, every slot
        valid: the native kernel can do the layer's write and attention in one call."""
        return (self.decode_only and self.keep is None and k_scale is None and
                q.dtype in cpu_native.PAGE_DTYPES and k.dtype == v.dtype == k_cache.dtype and
                cpu_native.rows_of_contiguous_heads(k) and
                cpu_native.rows_of_contiguous_heads(v) and cpu_native.supports(k_cache, v_cache))

    def _write(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor, k_scale: torch.Tensor | None,
               v_scale: torch.Tensor | None) -> None:
        fmt = quant.format_of(k_cache)
        for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
            if self.keep is not None:
                x = x.index_select(0, self.keep)
            if fmt == "auto":
                self._put(cache, x.to(cache.dtype))
            elif fmt == "fp8":
                self._put(cache, quant.quantize_fp8(x, scale))
            else:
                codes, scales = quant.quantize(x, fmt)
                self._put(cache, codes)
                self._put(scale, scales)

    def _put(self, pages: torch.Tensor, rows: torch.Tensor) -> None:
        """pages[slot] = rows for the step's valid slots. A contiguous page tensor is a flat
        [slots, ...] view: one index_copy_ (measured faster than index_put_ with the
        (block, offset) pair, which any strides need); fp8 moves as bytes (no CPU
        index_copy_ for float8)."""
        if not pages.is_contiguous():
            pages.index_put_(self.write_index, rows)
            return
        if pages.dtype == quant.FP8_DTYPE:
            pages, rows = pages.view(torch.uint8), rows.view(torch.uint8)
        pages.view(-1, *pages.shape[2:]).index_copy_(0, self.write_slots, rows)

    def _attend(self, q: torch.Tensor, kv: reference._Pages, scale: float,
                given: tuple[torch.Tensor, torch.Tensor] | None,
                window: int | None = None) -> torch.Tensor:
        """``window``: a sliding-window layer's W. Its decodes and prefills take the native
        kernels with the window where the pages allow (else the torch path with the
        window's pages and masks)."""
        head_dim, num_kv_heads = q.shape[2], kv.num_kv_heads
        out = None
        # prefills the native kernel reads in place write q's dtype straight into out
        if self.native_prefill is None:
            self.native_prefill = bool(self.prefills) and kv.k_scale is None and \
                cpu_native.supports_prefill(q, kv.k_cache, kv.v_cache)
        native_prefill = self.native_prefill
        if not self.decode_only:
            out = torch.empty(q.shape, dtype=q.dtype if native_prefill else COMPUTE_DTYPE,
                              device=q.device)
        has_decodes = self.native_rows.numel() > 0
        if has_decodes and kv.k_scale is None and cpu_native.supports(kv.k_cache, kv.v_cache):
            o = cpu_native.paged_decode(q if self.decode_only else
                                        q.index_select(0, self.native_rows), kv.k_cache,
                                        kv.v_cache, self.native_tables, self.native_lens, scale,
                                        out_dtype=COMPUTE_DTYPE if out is None else out.dtype,
                                        window=window)
            if out is None:
                out = o
            else:
                out.index_copy_(0, self.native_rows, o)
        elif has_decodes:
            groups, pages, rows, unsort = self._torch_decode
            queries = q.index_select(0, rows).to(COMPUTE_DTYPE).unsqueeze(2)
            outs = []
            for i, g in enumerate(groups):
                shape = (g.num_seqs, -1, num_kv_heads, head_dim)
                # one gather per group, right before its SDPA: a group's K/V (~1 MB fp32)
                # is still in cache when SDPA reads it; one gather for all groups measured
                # slower (kernels docs, docs/BENCHMARKS.md)
                group_pages, mask = (pages[g.page_lo:g.page_hi], g.visible) \
                    if window is None else self._window_decode(window)[i]
                k, v = kv.gather(group_pages, COMPUTE_DTYPE)
                k = k.view(shape).transpose(1, 2)  # [m, Hkv, L, D]
                v = v.view(shape).transpose(1, 2)
                qg = queries[g.first:g.first + g.num_seqs]
                outs.append(F.scaled_dot_product_attention(qg, k, v, attn_mask=mask,
                                                           scale=scale, enable_gqa=True))
            o = (outs[0] if len(outs) == 1 else torch.cat(outs)).squeeze(2)
            if out is None:
                out = o.index_select(0, unsort)
            else:
                out.index_copy_(0, rows, o.to(out.dtype))
        if native_prefill:
            cpu_native.paged_prefill(q, kv.k_cache, kv.v_cache, self.native_prefill_tables,
                                     self.native_prefill_spans, scale, out, window=window)
            return out  # already q's dtype
        for i, p in enumerate(self.prefills):
            visible = p.visible if window is None else self._window_prefill(window)[i]
            if given is not None and visible is None:  # fresh: its keys are its own rows
                k = given[0][p.start:p.end].to(COMPUTE_DTYPE)
                v = given[1][p.start:p.end].to(COMPUTE_DTYPE)
            else:
                k, v = kv.gather(p.pages, COMPUTE_DTYPE)
                k, v = k.flatten(0, 1)[:p.seq_len], v.flatten(0, 1)[:p.seq_len]
            k = k.transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            v = v.transpose(0, 1).unsqueeze(0)
            qh = q[p.start:p.end].to(COMPUTE_DTYPE).transpose(0, 1).unsqueeze(0)
            if visible is None:
                o = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale,
                                                   enable_gqa=True)
            else:
                o = F.scaled_dot_product_attention(qh, k, v, attn_mask=visible, scale=scale,
                                                   enable_gqa=True)
            out[p.start:p.end] = o[0].transpose(0, 1)
        return out.to(q.dtype)
