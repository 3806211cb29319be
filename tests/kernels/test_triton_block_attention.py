"""kernels/triton_block_attention.py against the torch reference over block-quantized pages
(``BlockLayer.gather``: dequantized blocks, exact residual rows, then plain attention):
every format, GQA, uneven lengths (a partial last block, a whole one, one token), blocks
out of order, some blocks still in the residual window. Under the Triton interpreter on
CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels import block_quant as bq
from tests.kernels.block_pages import BS, HKV, HQ, block_layer, reference_decode

D = 32


@pytest.mark.parametrize("name", list(bq.FORMATS))
def test_decode_equals_the_torch_reference(name, device):
    from kvscope.kernels import triton_block_attention

    layer = block_layer(bq.FORMATS[name], seed=len(name), head_dim=D, device=device)
    tables = torch.tensor([[3, 2, 9, 0], [7, 11, 5, 1], [4, 6, 8, 10]], dtype=torch.int32,
                          device=device)
    # a partial last block (in the residual window: block 9 is not, block 2 is), four
    # whole blocks crossing a 16-key tile, one token
    for lens in ([19, 32, 1], [12, 17, 8]):
        lens = torch.tensor(lens, dtype=torch.int64, device=device)
        q = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(1)).to(device)
        got = triton_block_attention.block_decode(q, layer, tables, lens, D ** -0.5)
        torch.testing.assert_close(got.double(),
                                   reference_decode(q, layer, tables, lens, D ** -0.5),
                                   atol=2e-5, rtol=1e-4)


def test_bf16_queries_and_residual_rows(device):
    """A bf16 model: q, out and the residual rows in bf16 (on a GPU: bf16 tl.dot over the
    dequantized tiles), within bf16's rounding of the float64 reference."""
    from kvscope.kernels import triton_block_attention

    layer = block_layer(bq.FORMATS["k8v4"], seed=2, head_dim=D, device=device)
    layer.residual_k = layer.residual_k.bfloat16()
    layer.residual_v = layer.residual_v.bfloat16()
    tables = torch.tensor([[7, 11, 2, 0]], dtype=torch.int64, device=device)
    lens = torch.tensor([27], dtype=torch.int64, device=device)
    q = torch.randn(1, HQ, D, generator=torch.Generator().manual_seed(3)).to(device)
    got = triton_block_attention.block_decode(q.bfloat16(), layer, tables, lens, D ** -0.5)
    assert got.dtype == torch.bfloat16
    want = reference_decode(q.bfloat16().float(), layer, tables, lens, D ** -0.5)
    torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("name", ["kivi4", "kivi2"])
def test_prefill_with_cached_context_equals_the_torch_reference(name, device):
    """Prefill over cached context, a decode and a whole prompt in one batch: causal rows
    (query i of a sequence with context c sees keys <= c + i), query tiles of several
    tokens x GQA heads."""
    from kvscope.kernels import triton_block_attention

    layer = block_layer(bq.FORMATS[name], seed=7, head_dim=D, device=device)
    tables = torch.tensor([[3, 2, 9, 0], [7, 11, 5, 1], [4, 6, 8, 10]], dtype=torch.int32,
                          device=device)
    q_lens, lens = [7, 1, 11], [19, 30, 11]
    cu = torch.tensor([0, 7, 8, 19], dtype=torch.int32, device=device)
    q = torch.randn(19, HQ, D, generator=torch.Generator().manual_seed(8)).to(device)
    got = triton_block_attention.block_attention(
        q, layer, tables, torch.tensor(lens, device=device), cu, D ** -0.5)
    for s, (q_len, n) in enumerate(zip(q_lens, lens, strict=True)):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        k, v = layer.gather(tables[s, : (n + BS - 1) // BS].long(), torch.float32)
        k = k.flatten(0, 1)[:n].double().repeat_interleave(HQ // HKV, 1)
        v = v.flatten(0, 1)[:n].double().repeat_interleave(HQ // HKV, 1)
        logits = torch.einsum("qhd,khd->hqk", q[rows].double(), k) * D ** -0.5
        future = torch.arange(n, device=device)[None, :] > \
            torch.arange(q_len, device=device)[:, None] + (n - q_len)
        p = logits.masked_fill(future, float("-inf")).softmax(-1)
        torch.testing.assert_close(got[rows].double(), torch.einsum("hqk,khd->qhd", p, v),
                                   atol=2e-5, rtol=1e-4)
