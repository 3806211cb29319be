"""Block-quantized pages for the kernel tests (the C decode kernel, the Triton kernel) and
the torch reference they are held to: ``BlockLayer.gather`` (dequantized blocks, exact
residual rows), then plain attention in float64."""

from __future__ import annotations

import torch

from kvscope.kernels import block_quant as bq

BS, HKV, HQ, NB = 8, 2, 6, 12


def block_layer(fmt: bq.BlockFormat, seed: int, head_dim: int,
                device: str = "cpu") -> bq.BlockLayer:
    """NB blocks of BS tokens, keys with an outlier channel and an offset one (what
    per-channel scales are for), blocks 2 and 7 still in the residual window."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(NB, BS, HKV, head_dim, generator=g)
    k[..., 7] *= 15.0  # an outlier channel
    k[..., 9] += 6.0
    v = torch.randn(NB, BS, HKV, head_dim, generator=g)
    slot_of = torch.full((NB,), -1, dtype=torch.int64)
    slot_of[[2, 7]] = torch.tensor([1, 0])
    tensors = (*bq.quantize_keys(k, fmt), *bq.quantize_values(v, fmt),
               torch.randn(2, BS, HKV, head_dim, generator=g),
               torch.randn(2, BS, HKV, head_dim, generator=g), slot_of)
    return bq.BlockLayer(fmt, *(t.to(device) for t in tensors))


def reference_decode(q: torch.Tensor, layer: bq.BlockLayer, tables: torch.Tensor,
                     lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence over its first ``lens[s]`` keys, float64."""
    outs = []
    for s in range(q.shape[0]):
        n = int(lens[s])
        k, v = layer.gather(tables[s, : (n + BS - 1) // BS], torch.float32)
        k = k.flatten(0, 1)[:n].double().repeat_interleave(HQ // HKV, 1)
        v = v.flatten(0, 1)[:n].double().repeat_interleave(HQ // HKV, 1)
        p = (torch.einsum("hd,khd->hk", q[s].double(), k) * scale).softmax(-1)
        outs.append(torch.einsum("hk,khd->hd", p, v))
    return torch.stack(outs)
