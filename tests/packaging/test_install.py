"""The wheel, installed in a fresh venv with no torch: the base install is light enough
for vLLM's environment (no Qt, no torch) and registers the vLLM plugin's entry point;
`kvscope inspect` there names the extra it needs; with `[inspector]` added it carries the
sample recording and the workloads (importlib.resources), `kvscope inspect` renders the
sample offscreen, `kvscope load --list` works, and engine commands name the extra they
need.

Offline and bounded: the wheel is built from a copy of the working tree without build
isolation (the dev venv's setuptools); the venv installs from the local package index
and pip's cache. One venv checks both: the base install first, then the extra."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


# A path or pip setting inherited from the test process would let the fresh venv see the
# checkout (its kvscope.egg-info) and pip would call the wheel "already satisfied".
_INHERITED = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PIP_TARGET", "PIP_PREFIX", "PIP_USER")


def _run(cmd: list[str], cwd: Path, timeout: float = 240,
         **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in _INHERITED}
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**clean, "PIP_DISABLE_PIP_VERSION_CHECK": "1", **env})


def py_of(venv: Path) -> str:
    return str(venv / "bin" / "python")


def test_wheel_installs_without_torch_and_renders(tmp_path):
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    src = tmp_path / "src"
    src.mkdir()
    with tarfile.open(tmp_path / "src.tar", "w") as tar:  # the tree as git sees it
        for f in files:
            if not f.startswith("tests/") and (ROOT / f).is_file():
                tar.add(ROOT / f, arcname=f)
    with tarfile.open(tmp_path / "src.tar") as tar:
        tar.extractall(src, filter="data")
    r = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
              "-w", str(tmp_path / "dist"), "."], src)
    assert r.returncode == 0, r.stderr[-2000:]
    wheel = next((tmp_path / "dist").glob("kvscope-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvscope/sample.kvtrace" in names
    assert "kvscope/workloads/demo.json" in names

    venv = tmp_path / "venv"
    assert _run([sys.executable, "-m", "venv", str(venv)], tmp_path).returncode == 0
    py, kvscope = str(venv / "bin" / "python"), str(venv / "bin" / "kvscope")
    out = tmp_path / "elsewhere"  # outside the checkout: assets come from the wheel
    out.mkdir()
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run([py_of(venv), "-c", purelib], tmp_path).stdout.strip())
    before = {p.name for p in site.iterdir()}
    r = _run([str(venv / "bin" / "pip"), "install", "-q", "--no-deps", str(wheel)], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    # one name in someone else's environment: kvscope and its dist-info, nothing else
    assert {p.name for p in site.iterdir()} - before == {"kvscope", "kvscope-0.1.0.dist-info"}
    assert {n.split("/")[0] for n in names} == {"kvscope", "kvscope-0.1.0.dist-info"}
    assert "kvscope/kernels/cpu_paged_decode.c" in names  # the C kernels build from the wheel
    r = _run([str(venv / "bin" / "pip"), "install", "-q", "-c", str(ROOT / "constraints.txt"),
              str(wheel)], tmp_path, timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    assert Path(kvscope).is_file(), f"pip installed no kvscope command: {r.stdout[-2000:]}"
    r = _run([py, "-c", "import importlib.util as u, importlib.metadata as m; "
              "print([u.find_spec(n) for n in ('torch', 'PySide6', 'pyqtgraph')]); "
              "print([e.value for e in m.entry_points(group='vllm.general_plugins')])"], out)
    assert r.stdout.split("\n")[:2] == ["[None, None, None]",
                                         "['kvscope.engine.events.vllm.plugin:register']"], r.stdout
    r = _run([kvscope, "inspect", "--screenshot", str(out / "none.png")], out,
             QT_QPA_PLATFORM="offscreen")
    assert r.returncode == 2 and "pip install 'kvscope[inspector]'" in r.stderr, r.stderr
    r = _run([str(venv / "bin" / "pip"), "install", "-q", "-c", str(ROOT / "constraints.txt"),
              f"{wheel}[inspector]"], tmp_path, timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    r = _run([py, "-c", "import importlib.util as u; print(u.find_spec('torch'))"], out)
    assert r.stdout.strip() == "None", "the inspector install pulled torch"
    r = _run([kvscope, "load", "--list"], out)
    assert r.returncode == 0 and "demo" in r.stdout, r.stderr
    r = _run([kvscope, "inspect", "--screenshot", str(out / "sample.png")], out,
             QT_QPA_PLATFORM="offscreen")
    assert r.returncode == 0 and (out / "sample.png").stat().st_size > 10_000, r.stderr
    for live in (["--connect", "tcp://127.0.0.1:9"], ["--connect-vllm", "tcp://127.0.0.1:9"]):
        # live mode loads without torch; nobody publishes there: exit 3, "no state/events"
        r = _run([kvscope, "inspect", *live, "--wait", "0.5", "--screenshot",
                  str(out / "live.png")], out, QT_QPA_PLATFORM="offscreen")
        assert r.returncode == 3 and "kvscope inspect: no" in r.stderr, r.stderr
    r = _run([kvscope, "serve"], out)
    assert r.returncode == 2 and "pip install 'kvscope[engine]'" in r.stderr, r.stderr
