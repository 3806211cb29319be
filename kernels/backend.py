"""Which implementation runs a kernel call: Triton for CUDA tensors, the torch reference for
CPU tensors, unless overridden.

Override order (first wins): the innermost ``force_backend(...)`` context, then the
environment variable ``KVSCOPE_KERNELS`` (``triton`` | ``reference``, read at each call),
then the device of the call's first tensor. Forcing ``triton`` on CPU tensors runs the
Triton interpreter, which needs ``TRITON_INTERPRET=1`` in the environment *before* the
kernel modules are imported (Triton reads it when ``@triton.jit`` decorates a kernel).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import torch

BACKENDS = ("triton", "reference")
ENV_VAR = "KVSCOPE_KERNELS"

_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvscope_kernels_backend",
                                                                     default=None)


@contextlib.contextmanager
def force_backend(name: str) -> Iterator[None]:
    """Route every kernel call in this context (this thread / task) to ``name``."""
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; choose one of {BACKENDS}")
    token = _forced.set(name)
    try:
        yield
    finally:
        _forced.reset(token)


def select_backend(device: torch.device) -> str:
    """The backend for a call whose tensors live on ``device``."""
    name = _forced.get() or os.environ.get(ENV_VAR) or None
    if name is None:
        return "triton" if device.type == "cuda" else "reference"
    if name not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={name!r} is not one of {BACKENDS}")
    if name == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the Triton backend on CPU tensors runs the Triton interpreter: set "
                           "TRITON_INTERPRET=1 before kernels' Triton modules are imported")
    return name
