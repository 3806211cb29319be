"""Server tests run a REAL daemon (`python -m engine.cli serve`) as a subprocess on a free
loopback port (port 0: the daemon binds and prints its address). Loading the model costs
seconds, so each module starts one daemon; the small KV pool and short answers keep
every request cheap on a 2-core CPU."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from engine.load.summary import parse_metrics

REPO = Path(__file__).resolve().parents[2]
READY = re.compile(r"ready on (http://\S+)")
START_TIMEOUT_S = 180  # the model load is slow on a loaded 2-core machine


@dataclass
class Daemon:
    proc: subprocess.Popen
    url: str
    record: Path | None
    lines: list[str] = field(default_factory=list)  # everything it printed

    def metrics(self) -> dict[str, float]:
        r = httpx.get(self.url + "/metrics", timeout=30)
        r.raise_for_status()
        return parse_metrics(r.text)

    def wait_metric(self, name: str, value: float, timeout: float = 30.0) -> dict[str, float]:
        end = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m.get(name) == value or time.monotonic() > end:
                return m
            time.sleep(0.1)

    def terminate(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    @property
    def output(self) -> str:
        return "".join(self.lines)


def start_daemon(*args: str, record: Path | None = None,
                 env: dict[str, str] | None = None, module: str = "engine.cli") -> Daemon:
    """``module`` runs instead of engine.cli (e.g. tests.server.faulty_serve)."""
    cmd = [sys.executable, "-m", module, "serve", "--port", "0", *args]
    if record is not None:
        cmd += ["--record", str(record)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **(env or {})})
    lines: list[str] = []
    found: list[str] = []
    ready = threading.Event()

    def reader() -> None:  # keeps draining the pipe so the daemon never blocks on it
        for line in proc.stdout:
            lines.append(line)
            m = READY.search(line)
            if m and not found:
                found.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=reader, daemon=True).start()
    ready.wait(START_TIMEOUT_S)
    if not found:
        proc.kill()
        proc.wait()
        raise RuntimeError("daemon did not start:\n" + "".join(lines))
    return Daemon(proc, found[0], record, lines)


def stop_daemon(d: Daemon) -> None:
    try:
        d.terminate()
    except subprocess.TimeoutExpired:
        d.proc.kill()
        d.proc.wait()


# 96 blocks x 16 = 1536 KV tokens, contexts up to 2048: a prompt between the two is
# refused by the engine (it could never fit), one over 2048 by the context check.
SHARED = ("--num-gpu-blocks", "96", "--max-model-len", "2048", "--max-num-seqs", "8",
          "--max-body-bytes", "65536", "--max-n", "4")
CAPACITY_TOKENS = 96 * 16


@pytest.fixture(scope="package")
def daemon() -> Iterator[Daemon]:
    """One daemon for the API, bad-input and load tests (they leave it idle)."""
    d = start_daemon(*SHARED)
    yield d
    stop_daemon(d)
