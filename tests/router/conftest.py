"""Router tests run REAL processes on loopback: `kvscope serve` replicas with event streams
and a `kvscope route` in front. Small KV pools, one thread per replica and short answers
keep them cheap on a 2-core machine. Only the failure points that a real process cannot
hit on cue (a replica dying before its headers, mid-body, before a stream's first chunk)
are played by a simulated fleet (test_retry.py)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # the fleet view test draws offscreen

import httpx
import pytest

from tests.waiting import HANG_S

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = HANG_S
REPLICA_ARGS = ("--num-gpu-blocks", "64", "--max-model-len", "1024", "--max-num-seqs", "4")


@dataclass
class Proc:
    cmd: list[str]
    proc: subprocess.Popen
    lines: list[str] = field(default_factory=list)
    url: str = ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(HANG_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


READY_RE = r"^kvscope \w+: ready on (http://\S+)"  # the process's own line, not a child's


def launch(cmd: list[str], env: dict[str, str] | None = None,
           ready_re: str = READY_RE) -> tuple[Proc, threading.Event]:
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, **(env or {})})
    p, ready = Proc(cmd, proc), threading.Event()

    def reader() -> None:  # drains the pipe so the process never blocks on it
        for line in proc.stdout:
            p.lines.append(line)
            m = re.search(ready_re, line)
            if m and not p.url:
                p.url = m.group(1)
                ready.set()
        ready.set()

    threading.Thread(target=reader, daemon=True).start()
    return p, ready


def wait_ready(p: Proc, ready: threading.Event) -> Proc:
    ready.wait(START_TIMEOUT_S)
    if not p.url:
        p.stop(signal.SIGKILL)
        raise RuntimeError(f"{p.cmd[3]} did not start:\n" + "".join(p.lines))
    return p


def free_port_pair() -> int:
    """A port P with P and P + 1 free (the event stream and its snapshot endpoint)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        with socket.socket() as s2:
            try:
                s2.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ReplicaSpec:
    http_port: int
    events_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    def serve_cmd(self) -> list[str]:
        return [sys.executable, "-m", "kvscope.engine.cli", "serve", "--port", str(self.http_port),
                "--events", self.events, *REPLICA_ARGS]


def launch_replica(spec: ReplicaSpec) -> tuple[Proc, threading.Event]:
    return launch(spec.serve_cmd(), env={"OMP_NUM_THREADS": "1"})


@dataclass
class Cluster:
    specs: list[ReplicaSpec]
    replicas: list[Proc | None]
    router: Proc

    def replica_index(self, name: str) -> int:
        return int(name.removeprefix("r"))

    def status(self) -> dict:
        return httpx.get(self.router.url + "/router/replicas", timeout=HANG_S).json()

    def wait_for(self, pred, timeout: float = HANG_S) -> dict:  # noqa: ANN001
        """The replicas' status once ``pred`` holds for it (or at the hang guard)."""
        end = time.monotonic() + timeout
        while True:
            st = self.status()
            if pred(st) or time.monotonic() > end:
                return st
            time.sleep(0.1)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    specs = [ReplicaSpec(free_port(), free_port_pair()) for _ in range(2)]
    started = [launch_replica(s) for s in specs]  # load both models at once
    replicas: list[Proc | None] = []
    try:
        for p, ready in started:
            replicas.append(wait_ready(p, ready))
        cmd = [sys.executable, "-m", "kvscope.engine.cli", "route", "--port", "0",
               "--policy", "prefix"]
        for s in specs:
            cmd += ["--replica", f"{s.url},{s.events}"]
        router = wait_ready(*launch(cmd))
        c = Cluster(specs, replicas, router)
        c.wait_for(lambda st: all(r["in_rotation"] and r["block_size"]
                                  for r in st["replicas"]))
        yield c
        router.stop()
    finally:
        for p in [p for p, _ in started] + [r for r in replicas if r is not None]:
            p.stop()
