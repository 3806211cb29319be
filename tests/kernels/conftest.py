"""Kernel tests run the Triton kernels on CUDA when there is a GPU, else under the Triton
interpreter on CPU.

Triton decides between the compiled and the interpreted kernel when ``@triton.jit``
decorates it, and decorates its own library (``tl.zeros``, ...) when ``triton`` is first
imported: the interpreter must be on before anything imports triton, and much does
(transformers' model code imports torch._dynamo, which imports triton). tests/conftest.py
sets ``TRITON_INTERPRET=1`` for the whole pytest process on a machine without a GPU; this
fixture checks that it held and imports the kernels.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="package", autouse=True)
def triton_interpreter_on_cpu():
    if HAS_CUDA:
        yield
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("no GPU and TRITON_INTERPRET is not 1: tests/conftest.py sets it for the "
                    "pytest process; the Triton kernel tests cannot run on CPU without it")
    if "triton" in sys.modules and type(sys.modules["triton"].language.zeros).__name__ == \
            "JITFunction":
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: the Triton kernel "
                    "tests cannot run in this process")
    import kvscope.kernels.triton_backend  # noqa: F401  (decorate the kernels as interpreted)

    yield


@pytest.fixture
def device() -> str:
    """Where the Triton kernels run: the GPU when present, else CPU (the interpreter)."""
    return "cuda" if HAS_CUDA else "cpu"
