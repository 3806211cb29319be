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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import quant
from kernels import reference as _ref

FULL, INT8, INT4 = 0, 2, 3
FORMAT_IDS = {"full": FULL, "int8": INT8, "int4": INT4}
FORMAT_NAMES = {v: k for k, v in FORMAT_IDS.items()}


@dataclass(frozen=True)
class MixedLayout:
    """The geometry of one mixed arena. ``formats``: the quantized formats a block may be
    demoted to ("int8", "int4" or both); full precision is always allowed."""

    dtype: torch.dtype
    block_size: int
    num_kv_heads: int
    head_dim: int
    formats: tuple[str, ...] = ("int8", "int4")

    def __post_init__(self) -> None:
        if not self.formats or any(f not in ("int8", "int4") for f in self.formats):
            raise ValueError(f"demotion formats must be int8 and/or int4, got {self.formats}")
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

    def subs(self, fmt: str) -> int:
        """Pages of format ``fmt`` ("full", "int8", "int4") one frame holds."""
        return {"full": 1, "int8": self.row_bytes // self.head_dim,
                "int4": self.row_bytes // (self.head_dim // 2)}[fmt]

    @property
    def max_subs(self) -> int:
        """K of the page code: sub-pages per frame of the smallest enabled format."""
        return max(self.subs(f) for f in self.formats)

    @property
    def scale_params(self) -> int:
        """P: fp16 scale columns per token-head row of a frame."""
        return max(self.subs(f) * quant.scale_params(f) for f in self.formats)

    @property
    def frame_bytes(self) -> int:
        """One frame of one layer's K (or V): codes plus the reserved scale columns."""
        return self.block_size * self.num_kv_heads * (self.row_bytes + 2 * self.scale_params)

    @property
    def num_codes(self) -> int:
        """Page codes are < num_frames * num_codes_per_frame; this is per frame."""
        return self.max_subs * 4

    def code(self, frame: int, sub: int, fmt: str) -> int:
        return ((frame * self.max_subs + sub) << 2) | FORMAT_IDS[fmt]

    def allocate(self, num_frames: int, device: torch.device | str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """A zeroed arena ``[F, bs, Hkv, C]`` uint8 and its scales ``[F, bs, Hkv, P]`` fp16."""
        shape = (num_frames, self.block_size, self.num_kv_heads)
        return (torch.zeros((*shape, self.row_bytes), dtype=torch.uint8, device=device),
                torch.zeros((*shape, self.scale_params), dtype=quant.SCALE_DTYPE,
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
               codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The pages ``codes [n]`` dequantized to ``[n, bs, Hkv, D]`` in ``dtype``."""
    fid, frame, sub = decode_codes(codes, layout)
    views = layout.views(arena)
    if bool((fid == FULL).all()):  # the common case: one gather, no masks
        return views["full"].index_select(0, frame).to(dtype)
    out = torch.empty((codes.numel(), layout.block_size, layout.num_kv_heads,
                       layout.head_dim), dtype=dtype, device=arena.device)
    for fmt, f_id in FORMAT_IDS.items():
        rows = (fid == f_id).nonzero().flatten()
        if not rows.numel():
            continue
        fr = frame[rows]
        if fmt == "full":
            out[rows] = views["full"].index_select(0, fr).to(dtype)
            continue
        s = sub[rows]
        c = views[fmt][fr, :, :, s]  # [m, bs, Hkv, Dp]: advanced indices go first
        p = quant.scale_params(fmt)
        cols = s[:, None] * p + torch.arange(p, device=s.device)
        sc = scales[fr[:, None], :, :, cols].permute(0, 2, 3, 1)  # [m, bs, Hkv, P]
        out[rows] = quant.dequantize(c, sc, fmt, dtype)
    return out


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
        return (read_pages(self.layout, self.k, self.ks, codes, dtype),
                read_pages(self.layout, self.v, self.vs, codes, dtype))


def paged_attention(q: torch.Tensor, layout: MixedLayout, k_arena: torch.Tensor,
                    v_arena: torch.Tensor, k_scales: torch.Tensor, v_scales: torch.Tensor,
                    code_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, scale: float, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``kernels.paged_attention`` over a mixed arena: ``code_tables [B, max_blocks]``
    holds page codes (module docstring). Triton on CUDA (or under ``force_backend``), the
    torch reference on CPU."""
    from kernels.backend import select_backend

    if select_backend(q.device) == "triton":
        from kernels import triton_attention

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
           src_codes: torch.Tensor, dst_codes: torch.Tensor) -> None:
    """Re-encode pages ``src_codes[i]`` as ``dst_codes[i]`` (int8 or int4 sub-pages), in
    place, for one arena (call once per layer for K and for V). Batched, in two phases:
    every source is gathered (dequantized, fp32) before any destination is written, so a
    destination may lie in a frame a source of the same batch leaves (the planner packs
    demoted pages into their own emptied frames: engine.cache.mixed_pool). Phase 2 is one
    Triton launch on CUDA (``triton_cache.demote_scatter``), torch index_put on CPU; both
    write the codes and scales of ``kernels.quant`` (what reshape_and_cache writes)."""
    if src_codes.numel() == 0:
        return
    values = read_pages(layout, arena, scales, src_codes, torch.float32)
    fid, frame, sub = decode_codes(dst_codes, layout)
    if bool((fid == FULL).any()):
        raise ValueError("demotion targets must be int8 or int4 pages")
    from kernels.backend import select_backend

    if select_backend(arena.device) == "triton":  # one scatter launch for the batch
        from kernels import triton_cache

        triton_cache.demote_scatter(layout, arena, scales, values, dst_codes)
        return
    views = layout.views(arena)
    for fmt in layout.formats:
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

