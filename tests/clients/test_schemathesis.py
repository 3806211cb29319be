"""schemathesis fuzzes the daemon from its own OpenAPI document (the request models are
in it): no generated input may yield a 5xx, and the daemon must keep serving."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import Daemon

EXAMPLES = 5  # per operation: bounded (each valid body runs the model)
# A healthy run takes minutes here (2.5 on a loaded 2-core box); these are hang guards, far
# past what a loaded box needs, for the whole run and for one request.
RUN_GUARD_S = 1500
REQUEST_GUARD_S = 300


@pytest.mark.timeout(RUN_GUARD_S + 300)
def test_schemathesis_finds_no_server_error(daemon: Daemon, tmp_path: Path):
    st = Path(sys.executable).parent / "schemathesis"
    r = subprocess.run(
        [str(st), "run", daemon.url + "/openapi.json", "--checks", "not_a_server_error",
         "--phases", "examples,fuzzing", "-n", str(EXAMPLES),
         "--request-timeout", str(REQUEST_GUARD_S), "--generation-deterministic",
         "--continue-on-failure"],
        capture_output=True, text=True, timeout=RUN_GUARD_S, env={**os.environ, "NO_COLOR": "1"},
        cwd=tmp_path)  # it keeps a .schemathesis/ cache in its working directory
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
    assert "passed" in r.stdout
    assert daemon.proc.poll() is None
    assert httpx.get(daemon.url + "/health", timeout=REQUEST_GUARD_S).json()["status"] == "ok"
