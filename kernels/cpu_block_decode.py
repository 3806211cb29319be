"""Decode attention over block-quantized pages in C (kernels/cpu_block_decode.c), built and
loaded as the other native CPU kernels (``kernels.cpu_native.load_library``).

Invariants:
  * optional: ``kernel()`` is None when there is no compiler, the build or the load fails,
    or ``KVSCOPE_CPU_ATTENTION=torch`` is set (A/B runs); callers then take the torch path
    (``BlockLayer.gather`` + SDPA), which stays the reference;
  * reads codes, scales and the residual window in place; q and out are float32 in the
    pages' (rotated) basis: the caller rotates.
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from kvscope.kernels import block_quant as bq
from kvscope.kernels import cpu_native

SOURCE_NAME = "cpu_block_decode.c"


@functools.cache
def kernel() -> ctypes.CDLL | None:
    if os.environ.get(cpu_native.ENV_BACKEND, "").lower() == "torch":
        return None
    lib = cpu_native.load_library(SOURCE_NAME)
    if lib is None:
        return None
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn = lib.kvscope_block_decode
    fn.restype = i
    fn.argtypes = [p, p, p, p, p, p, p, p, p, p, p, p, i, i, i, i, p, i64, p, i, i, i, i, i,
                   ctypes.c_float, i, i, p, p, p, p, p, i]
    return lib


def supports(q: torch.Tensor, pages: bq.BlockLayer) -> bool:
    """float32 queries and residual rows on the CPU, every page tensor contiguous."""
    tensors = (*pages.key_tensors, *pages.value_tensors, pages.residual_k, pages.residual_v,
               pages.slot_of)
    return (q.device.type == "cpu" and q.dtype == torch.float32 and
            pages.residual_k.dtype == torch.float32 and
            all(t.is_contiguous() for t in tensors) and kernel() is not None)


def block_decode(q: torch.Tensor, pages: bq.BlockLayer, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, *, model_basis: bool = False,
                 new: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor:
    """One query token per sequence: q [S, Hq, D] -> [S, Hq, D] float32, attending over each
    sequence's ``seq_lens`` keys in its ``block_tables`` row (int64, contiguous, validated
    by the caller: every length within its table, every used block id < num_blocks).
    Arguments as ``supports`` requires.

    ``model_basis``: q is given, and out returned, in the model's basis; the kernel rotates
    them by the Hadamard matrix as the format stores K and V (else both are in the pages'
    basis already). ``new`` = (k, v [S, Hkv, D] float32, rows, offsets [S] int64): sequence
    s's step token, written (rotated likewise when ``model_basis``) into residual row
    ``rows[s]`` at ``offsets[s]`` before it is read -- the residual write of
    ``engine.runner.block_kv`` done in the same call."""
    lib = kernel()
    assert lib is not None and block_tables.dtype == seq_lens.dtype == torch.int64
    assert block_tables.is_contiguous() and seq_lens.is_contiguous()
    q = q.contiguous()
    num_seqs, num_q_heads, head_dim = q.shape
    out = torch.empty_like(q)
    fmt, table = pages.fmt, bq.scale_table()
    k_table = bq.scale_table(fmt.key_pair_bits)
    rot_k = int(model_basis and fmt.rotate_keys)
    rot_v = int(model_basis and fmt.rotate_values)
    ptrs = [0, 0, 0, 0]
    if new is not None:
        new = tuple(t.contiguous() for t in new)
        k, v, rows, offsets = new
        assert k.dtype == v.dtype == torch.float32 and k.shape == v.shape == (
            num_seqs, pages.num_kv_heads, head_dim)
        assert rows.dtype == offsets.dtype == torch.int64 and rows.numel() == num_seqs
        ptrs = [t.data_ptr() for t in new]
    rc = lib.kvscope_block_decode(
        q.data_ptr(), pages.k_codes.data_ptr(), pages.k_scales.data_ptr(),
        pages.k_supers.data_ptr(), pages.v_codes.data_ptr(), pages.v_scales.data_ptr(),
        pages.v_supers.data_ptr(), pages.residual_k.data_ptr(), pages.residual_v.data_ptr(),
        pages.slot_of.data_ptr(), table.data_ptr(), k_table.data_ptr(), fmt.key_bits,
        fmt.value_bits, int(fmt.keys_per_channel), fmt.key_pair_bits, block_tables.data_ptr(),
        block_tables.stride(0), seq_lens.data_ptr(), num_seqs, num_q_heads,
        pages.num_kv_heads, head_dim, pages.block_size, scale, rot_k, rot_v, *ptrs,
        out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError("native block-quantized decode kernel could not allocate its buffers")
    return out
