"""Mixed-precision pages: one KV arena whose blocks each have their own format.

Layout (per layer, K and V alike). The arena is ``num_frames`` fixed-size *frames*, each
exactly one full-precision page's codes, as bytes ``[F, block_size, Hkv, C]`` with
``C = head_dim * element_size`` (fp32 256 B, bf16/fp16 128 B at head_dim 64), plus a
scale arena ``[F, block_size, Hkv, P]`` fp16. A frame holds one of:

- one full-precision page: the frame's bytes viewed as ``[block_size, Hkv, head_dim]``;
- ``C // head_dim`` int8 pages (2 for bf16, 4 for fp32): int8 page ``j`` is the byte
  columns ``[j * head_dim, (j + 1) * head_dim)`` of every token-head row, its scale the
  scale column ``j``;
- ``C // (head_dim / 2)`` int4 pages (4 for bf16, 8 for fp32): columns
  ``[j * head_dim / 2, ...)``, (scale, zero) in scale columns ``2j, 2j + 1``.

So every format is a plain strided *view* of the same bytes (``views``), a sub-page's
token-head row stays one contiguous run (coalesced loads, as in a single-format pool),
and the kernels find any key with the same arithmetic: frame, slot, head, then a column
offset ``sub * row_bytes``. Why frames and not a byte allocator or per-format pools with a
boundary: demotion then never moves a frame's neighbours, a demoted page lands in any
frame with a free sub-slot, and a frame goes back to the free list when its last page
leaves; the allocator is a few counters (``engine.cache.mixed_pool``). The price is the
scale columns: P = 2 * (int4 pages per frame) fp16 values per token-head are reserved in
every frame (12.5% on top of a full page at head_dim 64), so at one byte budget the pool
holds 0.89x the full-precision pages of a single-format pool, 1.78x as int8 and 3.56x as
int4 pages (int4 reaches the ideal ratio; int8 loses its 1.94x to the reservation).

Block tables handed to the kernels hold *page codes*, not block ids:
``code = ((frame * K + sub) << 2) | format_id`` (``K`` = sub-pages per frame of the
smallest format, format ids as ``kernels.triton_cache.FORMAT_IDS``: 0 full, 2 int8,
3 int4). The engine translates its block ids (which never change when a block is
demoted, so the event mirror's tables never change either) to codes once per step.

Full pages store K/V as the model computed them (no rotation), so a pool that never
demotes computes exactly what a single-format pool computes.

Block-quantized pages (``kernels.block_quant``: kivi4, k8v4, kivi2; at most one of them per
layout, page format id 1 = ``BLOCK``). A frame holds ``subs`` of them, ``subs`` set by the
wider of K's and V's codes (kivi4: as int4; k8v4: as int8, V's 4-bit codes then use half
of the V frame; kivi2: twice int4's). Sub-page ``j``'s codes are the byte columns
``[j * w, (j + 1) * w)`` of every token-head row (``w`` = the K or V code width), and its
scales and fp16 supers (per-channel key pairs ``[Hkv, D, 2]`` or per-token ``[bs, Hkv, 2]``,
then ``[Hkv, 2]`` fp16) are bytes ``[j * side, (j + 1) * side)`` of the frame's scale
columns read as one flat run of bytes. K and V are stored in the Hadamard basis, as the
block formats do (``kernels.quant.hadamard``); reading a page rotates it back. Only
complete blocks are demoted (the planner's rule), so a block's per-channel key scales
cover all its tokens: the residual window of these formats is the full-precision pages.
The Triton kernels do not read these pages: a layout with a block format attends through
the torch reference on every device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.kernels import block_quant as bq
from kvscope.kernels import quant
from kvscope.kernels import reference as _ref

FULL, BLOCK, INT8, INT4 = 0, 1, 2, 3
FORMAT_IDS = {"full": FULL, "int8": INT8, "int4": INT4,
              **{name: BLOCK for name in bq.FORMATS}}
FORMAT_NAMES = {FULL: "full", INT8: "int8", INT4: "int4"}  # BLOCK: the layout's block format
KINDS = ("k", "v")


@dataclass(frozen=True)
class MixedLayout:
    """The geometry of one mixed arena. ``formats``: the quantized formats a block may be
    demoted to (int8, int4 and at most one block format of ``kernels.block_quant``); full
    precision is always allowed."""

    dtype: torch.dtype
    block_size: int
    num_kv_heads: int
    head_dim: int
    formats: tuple[str, ...] = ("int8", "int4")

    def __post_init__(self) -> None:
        if not self.formats or any(f not in FORMAT_IDS or f == "full" for f in self.formats):
            raise ValueError(f"demotion formats must be int8, int4 or one of "
                             f"{tuple(bq.FORMATS)}, got {self.formats}")
        if sum(f in bq.FORMATS for f in self.formats) > 1:
            raise ValueError(f"at most one block-quantized demotion format, got {self.formats}")
        if self.block_format is not None and self.head_dim & (self.head_dim - 1):
            raise ValueError(f"{self.block_format.name} pages are stored Hadamard-rotated: "
                             f"head_dim must be a power of two, got {self.head_dim}")
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"mixed pages need a float model dtype, got {self.dtype}")
        if self.head_dim % 2:
            raise ValueError(f"int4 pages need an even head_dim, got {self.head_dim}")

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def row_bytes(self) -> int:
        """C: bytes of one token-head row of a frame (one full-precision row)."""
        return self.head_dim * self.element_size

    @property
    def block_format(self) -> bq.BlockFormat | None:
        """The enabled block-quantized format (page format id ``BLOCK``), if any."""
        names = [f for f in self.formats if f in bq.FORMATS]
        return bq.FORMATS[names[0]] if names else None

    def subs(self, fmt: str) -> int:
        """Pages of format ``fmt`` ("full", "int8", "int4" or a block format) one frame
        holds."""
        if fmt in bq.FORMATS:
            f = bq.FORMATS[fmt]
            return self.row_bytes // (self.head_dim * max(f.key_bits, f.value_bits) // 8)
        return {"full": 1, "int8": self.row_bytes // self.head_dim,
                "int4": self.row_bytes // (self.head_dim // 2)}[fmt]

    @property
    def max_subs(self) -> int:
        """K of the page code: sub-pages per frame of the smallest enabled format."""
        return max(self.subs(f) for f in self.formats)

    def code_width(self, kind: str) -> int:
        """Bytes of one block-format page's token-head row of K (``kind`` "k") or V."""
        f = self.block_format
        return f.packed_dim(f.key_bits if kind == "k" else f.value_bits, self.head_dim)

    def side_bytes(self, kind: str) -> int:
        """Bytes of one block-format page's scales and supers, K or V (module docstring)."""
        f, h = self.block_format, self.num_kv_heads
        per_channel = kind == "k" and f.keys_per_channel
        pairs = h * self.head_dim * f.key_pair_bits // 4 if per_channel else \
            self.block_size * h * 2
        return pairs + h * 2 * bq.SUPER_DTYPE.itemsize

    def scale_params_of(self, kind: str) -> int:
        """P of K's (``kind`` "k") or V's arena: fp16 scale columns per token-head row."""
        p = max((self.subs(f) * quant.scale_params(f) for f in self.formats
                 if f not in bq.FORMATS), default=0)
        if self.block_format is not None:
            side = self.subs(self.block_format.name) * self.side_bytes(kind)
            rows = self.block_size * self.num_kv_heads
            p = max(p, -(-side // (2 * rows)))
        return p

    @property
    def scale_params(self) -> int:
        """P: fp16 scale columns per token-head row (the larger of K's and V's)."""
        return max(self.scale_params_of(k) for k in KINDS)

    def frame_bytes_of(self, kind: str) -> int:
        """One frame of one layer's K or V: codes plus the reserved scale columns."""
        return self.block_size * self.num_kv_heads * (
            self.row_bytes + 2 * self.scale_params_of(kind))

    @property
    def frame_bytes(self) -> int:
        """One frame of one layer, K and V together."""
        return sum(self.frame_bytes_of(k) for k in KINDS)

    @property
    def num_codes(self) -> int:
        """Page codes are < num_frames * num_codes_per_frame; this is per frame."""
        return self.max_subs * 4

    def code(self, frame: int, sub: int, fmt: str) -> int:
        return ((frame * self.max_subs + sub) << 2) | FORMAT_IDS[fmt]

    def allocate(self, num_frames: int, device: torch.device | str, kind: str = "k"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """A zeroed arena ``[F, bs, Hkv, C]`` uint8 and its scales ``[F, bs, Hkv, P]`` fp16
        (P of K's or V's arena: ``kind``)."""
        shape = (num_frames, self.block_size, self.num_kv_heads)
        return (torch.zeros((*shape, self.row_bytes), dtype=torch.uint8, device=device),
                torch.zeros((*shape, self.scale_params_of(kind)), dtype=quant.SCALE_DTYPE,
                            device=device))

    def views(self, arena: torch.Tensor) -> dict[str, torch.Tensor]:
        """The arena as each format's pages: full ``[F, bs, Hkv, D]`` (model dtype), int8
        ``[F, bs, Hkv, K8, D]``, int4 ``[F, bs, Hkv, K4, D/2]`` -- views, no copies."""
        f, bs, h, _ = arena.shape
        d = self.head_dim
        return {"full": arena.view(self.dtype),
                "int8": arena.view(torch.int8).view(f, bs, h, self.subs("int8"), d),
                "int4": arena.view(f, bs, h, self.subs("int4"), d // 2)}


def decode_codes(codes: torch.Tensor, layout: MixedLayout
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Page codes -> (format id, frame, sub), int64."""
    codes = codes.long()
    slot = codes >> 2
    return codes & 3, slot // layout.max_subs, slot % layout.max_subs


def check_codes(codes: torch.Tensor, layout: MixedLayout, num_frames: int) -> None:
    """ValueError unless every code names a frame in range and an enabled format with a
    sub-page that format has."""
    fid, frame, sub = decode_codes(codes, layout)
    ok = (codes >= 0) & (frame < num_frames) & (fid == FULL) & (sub == 0)
    for fmt in layout.formats:
        ok |= (codes >= 0) & (frame < num_frames) & (fid == FORMAT_IDS[fmt]) & \
            (sub < layout.subs(fmt))
    if not bool(ok.all()):
        bad = codes[~ok][:4].tolist()
        raise ValueError(f"page codes {bad} name no page of this arena ({num_frames} frames, "
                         f"formats full + {layout.formats})")


def read_pages(layout: MixedLayout, arena: torch.Tensor, scales: torch.Tensor,
               codes: torch.Tensor, dtype: torch.dtype, kind: str = "k") -> torch.Tensor:
    """The pages ``codes [n]`` dequantized to ``[n, bs, Hkv, D]`` in ``dtype`` (``kind``:
    whether ``arena`` holds K or V, which block-format pages encode differently)."""
    fid, frame, sub = decode_codes(codes, layout)
    views = layout.views(arena)
    if bool((fid == FULL).all()):  # the common case: one gather, no masks
        return views["full"].index_select(0, frame).to(dtype)
    out = torch.empty((codes.numel(), layout.block_size, layout.num_kv_heads,
                       layout.head_dim), dtype=dtype, device=arena.device)
    for f_id, name in FORMAT_NAMES.items():
        rows = (fid == f_id).nonzero().flatten()
        if not rows.numel():
            continue
        fr = frame[rows]
        if name == "full":
            out[rows] = views["full"].index_select(0, fr).to(dtype)
            continue
        s = sub[rows]
        c = views[name][fr, :, :, s]  # [m, bs, Hkv, Dp]: advanced indices go first
        p = quant.scale_params(name)
        cols = s[:, None] * p + torch.arange(p, device=s.device)
        sc = scales[fr[:, None], :, :, cols].permute(0, 2, 3, 1)  # [m, bs, Hkv, P]
        out[rows] = quant.dequantize(c, sc, name, dtype)
    rows = (fid == BLOCK).nonzero().flatten()
    if rows.numel():
        out[rows] = _read_block_pages(layout, arena, scales, frame[rows], sub[rows],
                                      kind).to(dtype)
    return out


def _block_codes(layout: MixedLayout, arena: torch.Tensor, kind: str) -> torch.Tensor:
    """The arena's bytes as block-format sub-pages ``[F, bs, Hkv, C / w, w]``."""
    w = layout.code_width(kind)
    f, bs, h, c = arena.shape
    return arena.view(f, bs, h, c // w, w)


def _side_columns(layout: MixedLayout, scales: torch.Tensor, frame: torch.Tensor,
                  sub: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the frame's scale columns as flat bytes ``[F, S]``, the byte columns ``[m, side]``
    of the pages (frame, sub))."""
    side = layout.side_bytes(kind)
    flat = scales.view(torch.uint8).view(scales.shape[0], -1)
    return flat, sub[:, None] * side + torch.arange(side, device=sub.device)


def _read_block_pages(layout: MixedLayout, arena: torch.Tensor, scales: torch.Tensor,
                      frame: torch.Tensor, sub: torch.Tensor, kind: str) -> torch.Tensor:
    """Block-format pages (frame, sub) ``[m]`` -> float32 ``[m, bs, Hkv, D]``, rotated back
    from the Hadamard basis."""
    fmt, m, h = layout.block_format, frame.numel(), layout.num_kv_heads
    codes = _block_codes(layout, arena, kind)[frame, :, :, sub]
    flat, cols = _side_columns(layout, scales, frame, sub, kind)
    side = flat[frame[:, None], cols]  # [m, side] bytes
    n_pairs = side.shape[1] - h * 2 * bq.SUPER_DTYPE.itemsize
    supers = side[:, n_pairs:].contiguous().view(bq.SUPER_DTYPE).view(m, h, 2)
    if kind == "k":
        shape = bq.key_scale_shape(fmt, m, layout.block_size, h, layout.head_dim)
        x = bq.dequantize_keys(codes, side[:, :n_pairs].reshape(shape), supers, fmt)
        rotated = fmt.rotate_keys
    else:
        x = bq.dequantize_values(codes, side[:, :n_pairs].reshape(m, layout.block_size, h, 2),
                                 supers, fmt)
        rotated = fmt.rotate_values
    return x @ _hadamard(layout, arena.device).T if rotated else x


def _write_block_pages(layout: MixedLayout, arena: torch.Tensor, scales: torch.Tensor,
                       frame: torch.Tensor, sub: torch.Tensor, values: torch.Tensor,
                       kind: str) -> None:
    """Quantize complete blocks ``values [m, bs, Hkv, D]`` (float32) into block-format
    pages (frame, sub): codes, scales and supers as ``kernels.block_quant`` writes them."""
    fmt, m = layout.block_format, frame.numel()
    rotate = fmt.rotate_keys if kind == "k" else fmt.rotate_values
    x = values @ _hadamard(layout, arena.device) if rotate else values
    quantize = bq.quantize_keys if kind == "k" else bq.quantize_values
    codes, pairs, supers = quantize(x, fmt)
    _block_codes(layout, arena, kind)[frame, :, :, sub] = codes
    flat, cols = _side_columns(layout, scales, frame, sub, kind)
    flat[frame[:, None], cols] = torch.cat(
        [pairs.reshape(m, -1), supers.contiguous().view(torch.uint8).reshape(m, -1)], dim=1)


def _hadamard(layout: MixedLayout, device: torch.device) -> torch.Tensor:
    return quant.hadamard(layout.head_dim, torch.float32, device)


class MixedPages:
    """One layer's mixed K/V arenas, as ``kernels.reference.attend_pages`` reads pages."""

    def __init__(self, layout: MixedLayout, k_arena: torch.Tensor, v_arena: torch.Tensor,
                 k_scales: torch.Tensor, v_scales: torch.Tensor) -> None:
        self.layout = layout
        self.k, self.v, self.ks, self.vs = k_arena, v_arena, k_scales, v_scales
        self.num_frames = k_arena.shape[0]
        self.num_blocks = self.num_frames * layout.num_codes  # the code range
        self.block_size, self.num_kv_heads = layout.block_size, layout.num_kv_heads

    def compute_dtype(self, q: torch.Tensor) -> torch.dtype:
        # What a single-format full-precision pool computes in, so an undemoted mixed pool
        # gives the same numbers.
        return torch.promote_types(self.layout.dtype, q.dtype)

    def gather(self, codes: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return (read_pages(self.layout, self.k, self.ks, codes, dtype, "k"),
                read_pages(self.layout, self.v, self.vs, codes, dtype, "v"))


def paged_attention(q: torch.Tensor, layout: MixedLayout, k_arena: torch.Tensor,
                    v_arena: torch.Tensor, k_scales: torch.Tensor, v_scales: torch.Tensor,
                    code_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, scale: float, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``kernels.paged_attention`` over a mixed arena: ``code_tables [B, max_blocks]``
    holds page codes (module docstring). Triton on CUDA (or under ``force_backend``), the
    torch reference on CPU and for a layout with a block format."""
    from kvscope.kernels.backend import select_backend

    if layout.block_format is None and select_backend(q.device) == "triton":
        from kvscope.kernels import triton_attention

        return triton_attention.paged_attention_mixed(
            q, layout, k_arena, v_arena, k_scales, v_scales, code_tables, seq_lens,
            cu_seqlens_q, scale, out=out)
    kv = MixedPages(layout, k_arena, v_arena, k_scales, v_scales)
    pages = (seq_lens.long() + layout.block_size - 1) // layout.block_size
    used = torch.arange(code_tables.shape[1], device=q.device)[None, :] < pages[:, None]
    if code_tables.shape[1] >= int(pages.max()):
        check_codes(code_tables[used], layout, kv.num_frames)
    return _ref.attend_pages(q, kv, code_tables, seq_lens, cu_seqlens_q, scale, out)


def demote(layout: MixedLayout, arena: torch.Tensor, scales: torch.Tensor,
           src_codes: torch.Tensor, dst_codes: torch.Tensor, kind: str = "k") -> None:
    """Re-encode pages ``src_codes[i]`` as ``dst_codes[i]`` (quantized sub-pages), in
    place, for one arena (call once per layer for K, ``kind`` "k", and for V, "v").
    Batched, in two phases: every source is gathered (dequantized, fp32) before any
    destination is written, so a destination may lie in a frame a source of the same batch
    leaves (the planner packs demoted pages into their own emptied frames:
    engine.cache.mixed_pool). Phase 2 for int8/int4 is one Triton launch on CUDA
    (``triton_cache.demote_scatter``), torch index_put on CPU; both write the codes and
    scales of ``kernels.quant`` (what reshape_and_cache writes). Block-format pages are
    written by torch on every device, with the codes of ``kernels.block_quant``."""
    if src_codes.numel() == 0:
        return
    values = read_pages(layout, arena, scales, src_codes, torch.float32, kind)
    fid, frame, sub = decode_codes(dst_codes, layout)
    if bool((fid == FULL).any()):
        raise ValueError("demotion targets must be quantized pages")
    block = (fid == BLOCK).nonzero().flatten()
    if block.numel():
        _write_block_pages(layout, arena, scales, frame[block], sub[block], values[block],
                           kind)
        if block.numel() == fid.numel():
            return
        rest = (fid != BLOCK).nonzero().flatten()
        values, dst_codes, fid, frame, sub = (values[rest], dst_codes[rest], fid[rest],
                                              frame[rest], sub[rest])
    from kvscope.kernels.backend import select_backend

    if select_backend(arena.device) == "triton":  # one scatter launch for the batch
        from kvscope.kernels import triton_cache

        triton_cache.demote_scatter(layout, arena, scales, values, dst_codes)
        return
    views = layout.views(arena)
    for fmt in ("int8", "int4"):
        rows = (fid == FORMAT_IDS[fmt]).nonzero().flatten()
        if not rows.numel():
            continue
        codes, sc = quant.quantize(values[rows], fmt)  # [m, bs, Hkv, Dp], [m, bs, Hkv, P]
        fr, s = frame[rows], sub[rows]
        views[fmt][fr, :, :, s] = codes
        p = quant.scale_params(fmt)
        cols = s[:, None] * p + torch.arange(p, device=s.device)
        scales[fr[:, None], :, :, cols] = sc.permute(0, 3, 1, 2)


def copy_frames(tensors: list[torch.Tensor], mapping: torch.Tensor) -> None:
    """Copy frame ``mapping[i, 0]`` to ``mapping[i, 1]`` in every tensor (arenas and
    scales): copy-on-write of a full-precision page. Sources are read before writes."""
    if mapping.numel() == 0:
        return
    src, dst = mapping[:, 0].long(), mapping[:, 1].long()
    for t in tensors:
        t.index_copy_(0, dst, t.index_select(0, src))

