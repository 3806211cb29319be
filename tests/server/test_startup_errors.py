"""`kvscope serve` refuses what it cannot open at start-up with one clear line and exit 2,
not a traceback: an event port taken (its snapshot port, derived as port + 1, included)
and a recording path that cannot be written."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.server.conftest import REPO
from tests.waiting import HANG_S


def _serve(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvscope.engine.cli", "serve", "--port", "0",
           "--model", "dummy:tiny", "--num-gpu-blocks", "16", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=HANG_S)


def _taken_port_pair() -> tuple[socket.socket, int]:
    """A listening socket on some port Q; returns it and Q - 1 (whose + 1 is taken)."""
    for _ in range(50):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        probe = socket.socket()
        try:
            probe.bind(("127.0.0.1", port - 1))  # the event port itself must be free
        except OSError:
            s.close()
            continue
        finally:
            probe.close()
        s.listen()
        return s, port - 1
    pytest.skip("no free pair of adjacent loopback ports")


def test_a_taken_snapshot_port_is_a_clear_error():
    held, port = _taken_port_pair()
    try:
        r = _serve("--events", f"tcp://127.0.0.1:{port}")
    finally:
        held.close()
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert f"tcp://127.0.0.1:{port + 1}" in r.stderr and "port + 1" in r.stderr


def test_an_unwritable_recording_is_a_clear_error(tmp_path):
    r = _serve("--record", str(tmp_path / "missing" / "run.kvtrace"))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "run.kvtrace" in r.stderr
