"""The runner's side of mixed-precision pages (``--kv-demotion``): the arenas, the attention
backend over page codes, and the execution of the cache manager's demotion orders.

The cache manager plans (engine.cache.demotion, engine.cache.mixed_pool: tensor-free);
this module owns the tensors (kernels.mixed_pages: layout and kernels). Block tables
reach the kernels as page codes (the scheduler's output carries them so:
``KVCacheManager.page_codes``); new tokens are written into full-precision pages only,
whose slot is ``frame * block_size + offset``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvscope import kernels
from kvscope.engine.cache.demotion import DemotionPolicy, parse_formats
from kvscope.kernels import mixed_pages as mp


def mixed_layout(kv_demotion: str, dtype: torch.dtype, model_config,
                 block_size: int) -> mp.MixedLayout | None:
    """The arena geometry for ``--kv-demotion`` (None when demotion is off)."""
    formats = parse_formats(kv_demotion)
    if not formats:
        return None
    return mp.MixedLayout(dtype, block_size, model_config.num_kv_heads, model_config.head_dim,
                          formats)


def bytes_per_frame(layout: mp.MixedLayout, num_layers: int) -> int:
    """One frame across all layers, K and V, reserved scale columns included."""
    return num_layers * layout.frame_bytes  # K and V together


def demotion_policy(layout: mp.MixedLayout, hot_window: int) -> DemotionPolicy:
    return DemotionPolicy(layout.formats, {f: layout.subs(f) for f in layout.formats},
                          hot_window)


@dataclass
class MixedKV:
    """Per layer: K and V arenas [F, bs, Hkv, C] uint8 and their scales [F, bs, Hkv, P]."""

    layout: mp.MixedLayout
    k_arenas: list[torch.Tensor]
    v_arenas: list[torch.Tensor]
    k_scales: list[torch.Tensor]
    v_scales: list[torch.Tensor]

    @classmethod
    def allocate(cls, layout: mp.MixedLayout, num_layers: int, num_frames: int,
                 device: torch.device) -> MixedKV:
        k, v, ks, vs = [], [], [], []
        for _ in range(num_layers):
            a, s = layout.allocate(num_frames, device, "k")
            k.append(a)
            ks.append(s)
            a, s = layout.allocate(num_frames, device, "v")
            v.append(a)
            vs.append(s)
        return cls(layout, k, v, ks, vs)

    def frames_of(self, codes: np.ndarray) -> np.ndarray:
        """Frames of full-precision page codes (the only pages new tokens go to)."""
        return (codes >> 2) // self.layout.max_subs

    @torch.inference_mode()
    def demote(self, orders: list[tuple[int, int]]) -> None:
        """Execute (source code, destination code) orders: one batched gather + quantize +
        scatter per arena (torch; on CUDA these are a handful of batched kernels, not one
        launch per block)."""
        if not orders:
            return
        device = self.k_arenas[0].device
        pairs = torch.tensor(orders, dtype=torch.int64, device=device)
        for kind, arenas, scales in (("k", self.k_arenas, self.k_scales),
                                     ("v", self.v_arenas, self.v_scales)):
            for arena, scale in zip(arenas, scales, strict=True):
                mp.demote(self.layout, arena, scale, pairs[:, 0], pairs[:, 1], kind)

    @torch.inference_mode()
    def copy(self, frame_orders: list[tuple[int, int]]) -> None:
        """Copy-on-write of full-precision pages, frame to frame."""
        if frame_orders:
            mapping = torch.tensor(frame_orders, dtype=torch.int64,
                                   device=self.k_arenas[0].device)
            mp.copy_frames([*self.k_arenas, *self.v_arenas], mapping)


class MixedPagedAttention:
    """The AttentionBackend over a mixed arena: write the step's K/V into their full
    pages, then attend over page codes (per-block format read by the kernel)."""

    def __init__(self, kv: MixedKV, scale: float) -> None:
        self.kv, self.scale = kv, scale
        self.batch = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        b, kv = self.batch, self.kv
        lay = kv.layout
        kernels.reshape_and_cache(k, v, kv.k_arenas[layer].view(lay.dtype),
                                  kv.v_arenas[layer].view(lay.dtype), b.slot_mapping)
        return mp.paged_attention(q, lay, kv.k_arenas[layer], kv.v_arenas[layer],
                                  kv.k_scales[layer], kv.v_scales[layer], b.block_tables,
                                  b.seq_lens, b.cu_seqlens_q, self.scale)

