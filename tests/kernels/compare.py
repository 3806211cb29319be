"""Run a batch through the Triton backend on the test device and through the CPU reference."""

from __future__ import annotations

import torch

from kvscope import kernels
from kvscope.kernels import reference
from tests.kernels.oracle import PagedBatch

# Triton vs reference. fp16/bf16 tolerances cover one rounding of the output plus, on GPU,
# half-precision P@V operands.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def triton_attention(batch: PagedBatch, device: str, scale: float, **options) -> torch.Tensor:
    dev = batch.to(device)
    with kernels.force_backend("triton"):
        out = kernels.paged_attention(dev.q, dev.k_cache, dev.v_cache, dev.block_tables,
                                      dev.seq_lens, dev.cu_seqlens_q, scale, **options)
    return out.cpu()


def reference_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    return reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                     batch.seq_lens, batch.cu_seqlens_q, scale)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
