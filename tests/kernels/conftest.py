"""Kernel tests run the Triton kernels on CUDA when there is a GPU, else under the Triton
interpreter on CPU.

How the interpreter gets switched on, and why it does not leak: Triton decides between the
compiled and the interpreted kernel when ``@triton.jit`` decorates it, i.e. when
``kernels.triton_attention`` / ``kernels.triton_cache`` are first imported. No test module
imports them at collection time (everything goes through the ``kernels`` dispatch), so this
package-scoped fixture sets ``TRITON_INTERPRET=1``, imports them, and restores the
environment when the last kernel test is done. Other test areas only ever reach the torch
reference on CPU, which never imports Triton's kernels; but torch.compile imports triton
itself, and Triton decorates its own library when imported, so a process that compiled
before the kernel tests cannot interpret them: the fixture says so instead of failing each
test with Triton's "Cannot call @triton.jit'd outside of the scope of a kernel".
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
    if "kernels.triton_attention" in sys.modules and not getattr(
            sys.modules["kernels.triton_attention"], "_INTERPRET", False):
        pytest.fail("kernels' Triton modules were imported before TRITON_INTERPRET=1 was set; "
                    "their kernels cannot run on CPU in this process")
    if "triton" in sys.modules and type(sys.modules["triton"].language.zeros).__name__ == \
            "JITFunction":
        # Triton decorates its own library (tl.zeros, ...) at `import triton`: imported
        # without the interpreter, those functions cannot run inside an interpreted kernel.
        pytest.fail("triton was imported before TRITON_INTERPRET=1 was set (torch.compile "
                    "imports it: an earlier test area compiled something); the Triton kernel "
                    "tests cannot run in this process. Run tests/kernels first or on its own "
                    "(make test's order runs it before tests/model).")
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    import kernels.triton_backend  # noqa: F401  (decorate the kernels as interpreted)

    yield
    if old is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = old


@pytest.fixture
def device() -> str:
    """Where the Triton kernels run: the GPU when present, else CPU (the interpreter)."""
    return "cuda" if HAS_CUDA else "cpu"
