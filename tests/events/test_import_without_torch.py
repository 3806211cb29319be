"""kvscope.engine.events (and every submodule) imports with torch and triton unimportable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.waiting import HANG_S

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = """
import importlib.abc, pkgutil, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton"):
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Block())
import kvscope.engine.events
names = []
for info in pkgutil.walk_packages(kvscope.engine.events.__path__, "kvscope.engine.events."):
    __import__(info.name)
    names.append(info.name)
assert not any(m.split(".")[0] in ("torch", "triton") for m in sys.modules), "torch leaked"
import kvscope.engine.bench.synthetic  # the synthetic workload feeds torch-free benches and tests
assert not any(m.split(".")[0] in ("torch", "triton") for m in sys.modules), "torch leaked"
print(" ".join(sorted(names)))
"""


def test_events_import_without_torch():
    out = subprocess.run([sys.executable, "-c", BLOCKER], cwd=ROOT, capture_output=True,
                         text=True, timeout=HANG_S)
    assert out.returncode == 0, out.stderr
    for mod in ("wire.codec", "wire.stream", "wire.subscriber", "wire.recording",
                "wire.publisher", "analysis.lifecycle", "analysis.export", "vllm.translate"):
        assert f"kvscope.engine.events.{mod}" in out.stdout.split()
