"""The model's linear layers (fused QKV, o_proj, fused gate/up, down, lm_head), chosen once at
load time per weight: oneDNN pre-packed weights on CPU, plain ``F.linear`` elsewhere.

Why packing: ``F.linear`` on CPU runs a GEMM over the row-major ``[out, in]`` weight and
re-lays it out inside the BLAS call on every step. oneDNN's packed linear (the op inductor's
CPU freezing pass and vLLM-CPU's unquantized GEMM dispatch use) reorders the weight once into
its blocked layout, so a step pays no relayout (docs/cpu-kernels.md has the numbers).
The packed layout does not depend on the batch size (the hint only tunes it).

Invariants: a ``Linear`` returns exactly the shape and dtype ``F.linear(x, weight, bias)``
would, for 2-D ``x [M, in]`` with any M >= 0; its ``weight`` is the unpacked ``[out, in]``
weight (a packed linear keeps only the packed copy and unpacks it, exactly, on each read:
tensor-parallel sharding and tests read it, the forward never does). CUDA and every
unsupported case (no oneDNN, fp16, a failed self-check) use ``F.linear`` (cuBLAS on GPU).
``KVSCOPE_CPU_LINEAR=dense`` forces ``F.linear`` on CPU too (A/B measurements, debugging).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

ENV_VAR = "KVSCOPE_CPU_LINEAR"
CHOICES = ("packed", "dense")
# The batch-size hint oneDNN tunes its packed layout for (any M works): a decode batch.
_PACK_HINT = 32
_PACKABLE = (torch.float32, torch.bfloat16)

Linear = Callable[[torch.Tensor], torch.Tensor]


class DenseLinear:
    """``F.linear`` on the unpacked weight: GPU (cuBLAS), and the CPU fallback."""

    kind = "dense"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedCpuLinear:
    """oneDNN packed weight (``mkldnn._reorder_linear_weight``) run by
    ``mkldnn._linear_pointwise``; CPU, fp32/bf16, 2-D inputs."""

    kind = "packed"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features = weight.shape[0]
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT)
        self.bias = bias

    @property
    def weight(self) -> torch.Tensor:
        """The unpacked weight, rebuilt from the packed one (exact; a new tensor)."""
        return self.packed.to_dense()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:  # oneDNN rejects empty inputs
            return x.new_empty((0, self.out_features))
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none",
                                                  [], "")


def cpu_linear_choice() -> str:
    """``packed`` unless ``KVSCOPE_CPU_LINEAR=dense``; a bad value is a clear error."""
    name = os.environ.get(ENV_VAR, "packed")
    if name not in CHOICES:
        raise ValueError(f"{ENV_VAR}={name!r} is not one of {CHOICES}")
    return name


def _can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in _PACKABLE and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """The fastest measured linear for this weight's device and dtype (module docstring).

    A packed linear is checked once against ``F.linear`` on a small input; any error or a
    mismatch beyond rounding falls back to ``F.linear`` with a log line, never a failure."""
    if not _can_pack(weight) or cpu_linear_choice() == "dense":
        return DenseLinear(weight, bias)
    try:
        packed = PackedCpuLinear(weight, bias)
        with torch.inference_mode():
            x = torch.linspace(-1, 1, 3 * weight.shape[1], dtype=weight.dtype).view(3, -1)
            want = F.linear(x, weight, bias).float()
            got = packed(x).float()
        tol = 1e-3 if weight.dtype == torch.float32 else 5e-2
        if got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=tol):
            raise RuntimeError("packed linear disagrees with F.linear")
    except RuntimeError as e:
        log.warning("oneDNN packed linear unavailable (%s); using F.linear", e)
        return DenseLinear(weight, bias)
    return packed
