"""Fused per-token elementwise CPU kernels (kernels/cpu_fused.c, built and loaded by
``kernels.cpu_native.load_library``): RMSNorm, residual add + RMSNorm, RoPE in place on the
q/k heads of the fused qkv output.

Why: at one decode token these ops touch a few hundred values each, and the torch code
(engine/model/llama.py, engine/model/rope.py, kept as the reference and the fallback) runs
each as 5-8 separate ops that mostly pay dispatch (~12 us per RMSNorm, 61 RMSNorms a step).

Invariants:
  * optional: ``applies`` is False when the library cannot be built or loaded, while
    ``torch.compile`` traces the forward (inductor fuses these ops itself), for tensors off
    the CPU or of another dtype than float32/bfloat16, or when ``KVSCOPE_CPU_ATTENTION=torch``
    is set: that one switch turns off every native CPU kernel (the decode attention and
    these), for A/B runs against the torch ops. Callers then take their torch path;
  * bfloat16 results are bit-identical to the torch code's except for the order of the
    RMSNorm sum of squares (float32 either way); float32 RoPE and residual adds are
    bit-identical (the C file says why);
  * the wrappers require contiguous CPU rows of one dtype (ValueError otherwise: the C
    code trusts them), write only the tensors they document, and run on torch's intra-op
    thread count.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from kvscope.kernels import cpu_native

log = logging.getLogger(__name__)

SOURCE_NAME = "cpu_fused.c"
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The built fused kernels, or None (reason logged once) when they cannot be used."""
    if os.environ.get(cpu_native.ENV_BACKEND, "").lower() == "torch":
        log.info("%s=torch: CPU elementwise ops use torch", cpu_native.ENV_BACKEND)
        return None
    lib = cpu_native.load_library(SOURCE_NAME)
    if lib is None:
        return None
    p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    signatures = {
        "kvscope_rms_norm": [p, p, p, i64, i, f, i, i],
        "kvscope_add_rms_norm": [p, p, p, p, i64, i, f, i, i],
        "kvscope_rope": [p, i64, p, p, i64, i, i, i, i],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = None, argtypes
    return lib


def applies(x: torch.Tensor) -> bool:
    """Whether the forward may run its elementwise ops on ``x``'s kind of tensor natively."""
    return (x.is_cpu and x.dtype in DTYPES and not torch.compiler.is_compiling() and
            library() is not None)


# The checks below are cheap attribute reads on purpose: at one token a wrapper's whole
# Python side (checks, ctypes call) is what these kernels cost.
def _check(x: torch.Tensor, *others: torch.Tensor) -> None:
    if not (x.is_cpu and x.is_contiguous() and x.dtype in DTYPES):
        raise ValueError("fused CPU kernels take contiguous float32/bfloat16 CPU tensors")
    for t in others:
        if not (t.is_cpu and t.is_contiguous() and t.dtype is x.dtype):
            raise ValueError("fused CPU kernels take contiguous CPU tensors of one dtype")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``engine.model.llama.rms_norm(x, weight, eps)``: x [T, n], weight [n] -> new [T, n]."""
    _check(x, weight)
    if x.dim() != 2 or weight.numel() != x.shape[1]:
        raise ValueError("rms_norm: x [T, n] and weight [n]")
    out = torch.empty_like(x)
    library().kvscope_rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0],
                               x.shape[1], eps, x.dtype is torch.bfloat16,
                               torch.get_num_threads())
    return out


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """``hidden += delta`` IN PLACE, then returns ``rms_norm(hidden, weight, eps)`` (new)."""
    _check(hidden, delta, weight)
    if hidden.dim() != 2 or hidden.shape != delta.shape or weight.numel() != hidden.shape[1]:
        raise ValueError("add_rms_norm: hidden and delta [T, n], weight [n]")
    out = torch.empty_like(hidden)
    library().kvscope_add_rms_norm(hidden.data_ptr(), delta.data_ptr(), weight.data_ptr(),
                                   out.data_ptr(), hidden.shape[0], hidden.shape[1], eps,
                                   hidden.dtype is torch.bfloat16, torch.get_num_threads())
    return out


def rope_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
          head_dim: int) -> None:
    """RoPE IN PLACE on the first ``heads * head_dim`` columns of each row of qkv [T, W]
    (the q and k heads): ``RotaryEmbedding.apply`` on them. cos, sin: [T, 1, head_dim] or
    [T, head_dim], as ``RotaryEmbedding.cos_sin`` returns them."""
    _check(qkv, cos, sin)
    tokens = qkv.shape[0]
    if qkv.dim() != 2 or heads * head_dim > qkv.shape[1] or cos.numel() != tokens * head_dim or (
            sin.numel() != tokens * head_dim) or head_dim % 2:
        raise ValueError("rope_: qkv, cos and sin do not fit heads x head_dim")
    library().kvscope_rope(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(),
                           tokens, heads, head_dim, qkv.dtype is torch.bfloat16,
                           torch.get_num_threads())
