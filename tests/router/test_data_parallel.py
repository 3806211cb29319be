"""`kvscope serve --data-parallel-size 2`: two replicas and the router from one command
(on a tiny random model, so that the test is about the plumbing, not the model), both
replicas serve, a replica that dies is restarted on its ports, and SIGTERM stops all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.model.tiny_models import save_hf, tiny_hf_model
from tests.router.conftest import launch, wait_ready
from tests.waiting import HANG_S

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf(tiny_hf_model("llama"), tmp_path_factory.mktemp("tiny") / "llama")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(x) for x in out.split()]


def test_serve_data_parallel_starts_routes_restarts_and_stops(tiny_dir: Path) -> None:
    front = wait_ready(*launch([sys.executable, "-m", "kvscope.engine.cli", "serve", "--model",
                                str(tiny_dir), "--data-parallel-size", "2", "--port", "0",
                                "--num-gpu-blocks", "32", "--max-model-len", "128"]))
    try:
        line = next(ln for ln in front.lines if "data parallel" in ln)
        assert "2 replicas" in line and "CPU thread" in line
        served = set()
        for k in range(4):
            r = httpx.post(front.url + "/v1/completions", timeout=HANG_S,
                           json={"prompt": [5, 6, 7, k], "max_tokens": 2})
            assert r.status_code == 200, r.text
            served.add(r.headers["x-kvscope-replica"])
        assert served == {"r0", "r1"}
        kids = _children(front.proc.pid)
        assert len(kids) == 2
        os.kill(kids[0], signal.SIGKILL)
        end = time.monotonic() + HANG_S
        while time.monotonic() < end:
            st = httpx.get(front.url + "/router/replicas", timeout=HANG_S).json()["replicas"]
            if all(r["in_rotation"] for r in st) and sum(r["restarts"] for r in st) == 1:
                break
            time.sleep(0.2)
        assert all(r["in_rotation"] for r in st) and sum(r["restarts"] for r in st) == 1, st
        assert any("restarting it" in ln for ln in front.lines)
        front.proc.send_signal(signal.SIGTERM)
        assert front.proc.wait(HANG_S) == 0
        assert _children(front.proc.pid) == []
    finally:
        front.stop(signal.SIGKILL)
