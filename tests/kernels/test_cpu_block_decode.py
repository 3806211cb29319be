"""kernels/cpu_block_decode.c against the torch reference over block-quantized pages
(``BlockLayer.gather``: dequantized blocks, exact residual rows, then plain attention):
every format, GQA, several sequences of uneven lengths, blocks out of order, some blocks
still in the residual window."""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels import block_quant as bq
from kvscope.kernels import cpu_block_decode, quant
from tests.kernels.block_pages import HKV, HQ, block_layer, reference_decode

pytestmark = pytest.mark.skipif(cpu_block_decode.kernel() is None,
                                reason="no C compiler: the torch path is the only one")

D = 64


@pytest.mark.parametrize("name", list(bq.FORMATS))
def test_native_decode_equals_the_torch_reference(name):
    layer = block_layer(bq.FORMATS[name], seed=len(name), head_dim=D)
    tables = torch.tensor([[3, 2, 9, 0], [7, 11, 5, 1], [4, 6, 8, 10]], dtype=torch.int64)
    lens = torch.tensor([19, 32, 1], dtype=torch.int64)  # a partial block, full, one token
    q = torch.randn(3, HQ, D, generator=torch.Generator().manual_seed(1))
    got = cpu_block_decode.block_decode(q, layer, tables, lens, D ** -0.5)
    torch.testing.assert_close(got.double(), reference_decode(q, layer, tables, lens, D ** -0.5),
                               atol=2e-5, rtol=1e-4)


def test_supports_only_float32_contiguous_pages():
    layer = block_layer(bq.FORMATS["kivi4"], seed=0, head_dim=D)
    q = torch.randn(1, HQ, D)
    assert cpu_block_decode.supports(q, layer)
    assert not cpu_block_decode.supports(q.bfloat16(), layer)
    layer.residual_k = layer.residual_k.bfloat16()
    assert not cpu_block_decode.supports(q, layer)


@pytest.mark.parametrize("name", ["kivi4", "k8v4"])
def test_model_basis_call_writes_the_residual_rows_and_rotates_as_torch_does(name):
    """``model_basis`` + ``new``: the kernel's own Hadamard transforms and residual writes
    equal rotating and writing in torch, then calling it in the pages' basis."""
    fmt = bq.FORMATS[name]
    layer, twin = block_layer(fmt, seed=3, head_dim=D), block_layer(fmt, seed=3, head_dim=D)
    tables = torch.tensor([[3, 2, 9, 0], [7, 11, 5, 1]], dtype=torch.int64)
    lens = torch.tensor([20, 27], dtype=torch.int64)  # block 9: offset 3 of row 1 ...
    rows, offsets = torch.tensor([1, 0]), torch.tensor([3, 2])  # ... block 5: row 0, off 2
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, h, D, generator=g) for h in (HQ, HKV, HKV))
    h = quant.hadamard(D)
    got = cpu_block_decode.block_decode(q, layer, tables, lens, D ** -0.5, model_basis=True,
                                        new=(k, v, rows, offsets))
    twin.residual_k[rows, offsets] = k @ h
    twin.residual_v[rows, offsets] = v @ h
    want = cpu_block_decode.block_decode(q @ h, twin, tables, lens, D ** -0.5) @ h.T
    torch.testing.assert_close(layer.residual_k, twin.residual_k, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(layer.residual_v, twin.residual_v, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
