"""Test helper: a mixed arena filled with known values, and what each page should read as
(the independent expectation: quantize-then-dequantize through ``kernels.quant``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.kernels import block_quant as bq
from kvscope.kernels import mixed_pages as mp
from kvscope.kernels import quant


def block_page_reads(k: torch.Tensor, v: torch.Tensor, fmt: bq.BlockFormat
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """What one complete block ``[bs, Hkv, D]`` demoted to ``fmt`` reads as: K and V
    rotated by the Hadamard matrix, quantized by ``kernels.block_quant``, dequantized and
    rotated back (float32)."""
    h = quant.hadamard(k.shape[-1])
    kq = bq.quantize_keys(k.float()[None] @ h, fmt)
    vq = bq.quantize_values(v.float()[None] @ h, fmt)
    return (bq.dequantize_keys(*kq, fmt)[0] @ h.T, bq.dequantize_values(*vq, fmt)[0] @ h.T)


@dataclass
class FilledArena:
    layout: mp.MixedLayout
    k: torch.Tensor
    v: torch.Tensor
    ks: torch.Tensor
    vs: torch.Tensor
    codes: list[int]  # code of logical page i
    k_want: torch.Tensor  # [n, bs, Hkv, D] fp32: what page i must read as
    v_want: torch.Tensor

    def dense_tables(self, tables: torch.Tensor) -> torch.Tensor:
        return tables  # logical page ids index k_want / v_want directly

    def code_tables(self, tables: torch.Tensor) -> torch.Tensor:
        lut = torch.tensor(self.codes, dtype=torch.int32)
        return lut[tables.long()]


def filled_arena(formats_of_pages: list[str], dtype: torch.dtype, block_size: int,
                 num_kv_heads: int, head_dim: int, seed: int = 0,
                 enabled: tuple[str, ...] = ("int8", "int4")) -> FilledArena:
    """Logical pages with the given formats: each is written at full precision into its own
    frame, then the quantized ones are demoted (one batch) into sub-pages of later frames."""
    layout = mp.MixedLayout(dtype, block_size, num_kv_heads, head_dim, enabled)
    n = len(formats_of_pages)
    num_frames = 2 * n + 1
    gen = torch.Generator().manual_seed(seed)
    shape = (n, block_size, num_kv_heads, head_dim)
    kx = (torch.randn(shape, generator=gen) * 2).to(dtype)
    vx = torch.randn(shape, generator=gen).to(dtype)
    k, ks = layout.allocate(num_frames, "cpu", "k")
    v, vs = layout.allocate(num_frames, "cpu", "v")
    layout.views(k)["full"][:n] = kx
    layout.views(v)["full"][:n] = vx
    codes = [layout.code(i, 0, "full") for i in range(n)]
    # Quantized pages packed into frames n, n+1, ... in reverse order of the pages (so a
    # frame mixes pages of several sequences), sub-slots filled in order.
    src, dst = [], []
    frame, used, frame_fmt = n, {}, {}
    for i in reversed(range(n)):
        fmt = formats_of_pages[i]
        if fmt == "full":
            continue
        f = next((f for f, c in used.items() if frame_fmt[f] == fmt and c < layout.subs(fmt)),
                 None)
        if f is None:
            f, frame = frame, frame + 1
            used[f], frame_fmt[f] = 0, fmt
        src.append(codes[i])
        codes[i] = layout.code(f, used[f], fmt)
        dst.append(codes[i])
        used[f] += 1
    for kind, arena, scales in (("k", k, ks), ("v", v, vs)):
        mp.demote(layout, arena, scales, torch.tensor(src, dtype=torch.int64),
                  torch.tensor(dst, dtype=torch.int64), kind)
    # Scrub the source frames: a demoted page must be read from its new place only.
    for i, fmt in enumerate(formats_of_pages):
        if fmt != "full":
            k[i].fill_(0x7F)
            v[i].fill_(0x7F)
    k_want, v_want = kx.float().clone(), vx.float().clone()
    for i, fmt in enumerate(formats_of_pages):
        if fmt in bq.FORMATS:
            k_want[i], v_want[i] = block_page_reads(kx[i], vx[i], bq.FORMATS[fmt])
        elif fmt != "full":
            for want, x in ((k_want, kx), (v_want, vx)):
                c, s = quant.quantize(x[i].float(), fmt)
                want[i] = quant.dequantize(c, s, fmt)
    return FilledArena(layout, k, v, ks, vs, codes, k_want, v_want)
