"""Two ways to serve, for two kinds of test:

- in process (``served``, ``serve_in_process``; tests/server/asgi.py): the app called
  through ASGI over the real engine built from the same flags as ``kvscope serve``, for
  the tests about requests and their answers; or over a double (tests/server/doubles.py)
  where the test is about the server alone;
- a REAL daemon (``python -m engine.cli serve``, ``start_daemon``) as a subprocess on a free
  loopback port (port 0: the daemon binds and prints its address), for what needs a
  process: signals, drains, exit codes, a port for other programs (kvscope load, real
  clients), a recording written by a process that is killed.
Loading the model costs seconds, so a served engine or a daemon is shared by a module or
the package; the small KV pool and short answers keep every request cheap on a 2-core CPU."""

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

from kvscope.engine.loadgen.summary import parse_metrics
from tests.server.asgi import InProcess
from tests.waiting import HANG_S

REPO = Path(__file__).resolve().parents[2]
READY = re.compile(r"ready on (http://\S+)")
START_TIMEOUT_S = HANG_S  # the model load is slow on a loaded 2-core machine


@dataclass
class Daemon:
    proc: subprocess.Popen
    url: str
    record: Path | None
    lines: list[str] = field(default_factory=list)  # everything it printed
    eof: threading.Event = field(default_factory=threading.Event)  # all of it read

    def metrics(self) -> dict[str, float]:
        r = httpx.get(self.url + "/metrics", timeout=HANG_S)
        r.raise_for_status()
        return parse_metrics(r.text)

    def wait_metric(self, name: str, value: float, timeout: float = HANG_S) -> dict[str, float]:
        end = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m.get(name) == value or time.monotonic() > end:
                return m
            time.sleep(0.1)

    def terminate(self, timeout: float = HANG_S) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    @property
    def output(self) -> str:
        """What it printed; once it has exited, all of it (the reader may lag the exit)."""
        if self.proc.poll() is not None:
            assert self.eof.wait(HANG_S), "the daemon's output never ended"
        return "".join(self.lines)


def start_daemon(*args: str, record: Path | None = None,
                 env: dict[str, str] | None = None, module: str = "kvscope.engine.cli") -> Daemon:
    """``module`` runs instead of engine.cli (e.g. tests.server.faulty_serve)."""
    cmd = [sys.executable, "-m", module, "serve", "--port", "0", *args]
    if record is not None:
        cmd += ["--record", str(record)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **(env or {})})
    lines: list[str] = []
    found: list[str] = []
    ready, eof = threading.Event(), threading.Event()

    def reader() -> None:  # keeps draining the pipe so the daemon never blocks on it
        for line in proc.stdout:
            lines.append(line)
            m = READY.search(line)
            if m and not found:
                found.append(m.group(1))
                ready.set()
        eof.set()
        ready.set()

    threading.Thread(target=reader, daemon=True).start()
    ready.wait(START_TIMEOUT_S)
    if not found:
        proc.kill()
        proc.wait()
        raise RuntimeError("daemon did not start:\n" + "".join(lines))
    return Daemon(proc, found[0], record, lines, eof)


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
    """One daemon for the tests that point a program at its port (they leave it idle)."""
    d = start_daemon(*SHARED)
    yield d
    stop_daemon(d)


def serve_in_process(*args: str) -> InProcess:
    """``kvscope serve ARGS`` in this process: the same flags make the same engine and
    settings (engine.commands.serve), the engine loop runs on its own thread, and the app
    is called through ASGI."""
    from kvscope.engine.cli import build_parser
    from kvscope.engine.commands.serve import engine_config, model_of, server_settings
    from kvscope.engine.engine import LLMEngine
    from kvscope.engine.model.chat_template import load_chat_template
    from kvscope.engine.server.daemon import build_engine, build_state

    ns = build_parser().parse_args(["serve", *args])
    ns.model = model_of(ns)
    if ns.chat_template is not None:
        ns.chat_template = load_chat_template(ns.chat_template)
    engine = build_engine(LLMEngine, engine_config(ns))
    return InProcess(build_state(engine, server_settings(ns)))


@pytest.fixture(scope="package")
def served() -> Iterator[InProcess]:
    """The real engine with the daemon's flags (SHARED), in process, for the API,
    bad-input, compatibility, tool and structured-output tests (they leave it idle)."""
    s = serve_in_process(*SHARED)
    yield s
    s.close()
