"""Backend choice: device default, force_backend, KVSCOPE_KERNELS; lazy Triton import."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvscope import kernels
from kvscope.kernels.backend import select_backend

CPU = torch.device("cpu")


def test_cpu_defaults_to_reference_and_force_backend_nests(monkeypatch):
    monkeypatch.delenv("KVSCOPE_KERNELS", raising=False)
    assert select_backend(CPU) == "reference"
    with kernels.force_backend("triton"):
        assert select_backend(CPU) == "triton"
        with kernels.force_backend("reference"):
            assert select_backend(CPU) == "reference"
        assert select_backend(CPU) == "triton"
    assert select_backend(CPU) == "reference"


def test_env_override_and_context_precedence(monkeypatch):
    monkeypatch.setenv("KVSCOPE_KERNELS", "triton")
    assert select_backend(CPU) == "triton"
    with kernels.force_backend("reference"):
        assert select_backend(CPU) == "reference"
    monkeypatch.setenv("KVSCOPE_KERNELS", "cuda")
    with pytest.raises(ValueError, match="KVSCOPE_KERNELS"):
        select_backend(CPU)


def test_bad_backend_name_and_cpu_triton_without_interpreter(monkeypatch):
    with pytest.raises(ValueError, match="unknown kernel backend"):
        with kernels.force_backend("cuda"):
            pass
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with kernels.force_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        select_backend(CPU)


def test_cpu_use_never_imports_triton_or_engine():
    code = (
        "import sys, torch\nfrom kvscope import kernels\n"
        "kc = torch.zeros(4, 4, 1, 8); vc = torch.zeros_like(kc)\n"
        "x = torch.ones(2, 1, 8)\n"
        "kernels.reshape_and_cache(x, x, kc, vc, torch.tensor([0, 5]))\n"
        "o = kernels.paged_attention(torch.ones(2, 2, 8), kc, vc, torch.tensor([[0, 1]],"
        " dtype=torch.int32), torch.tensor([6], dtype=torch.int32), torch.tensor([0, 2],"
        " dtype=torch.int32), 1.0)\n"
        "kernels.copy_blocks([kc], [vc], torch.tensor([[0, 2]]))\n"
        "kernels.swap_blocks(kc, vc, torch.tensor([[0, 3]]))\n"
        "bad = sorted(m for m in sys.modules\n"
        "             if m.split('.')[0] == 'triton' or m.startswith('kvscope.engine'))\n"
        "print(bad)\n"
    )
    env = {"PATH": "/usr/bin:/bin"}  # kvscope comes from the install, not the checkout
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_kernels_package_never_imports_engine():
    for path in Path(kernels.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.startswith(("engine", "kvscope.engine")) for n in names), path
