"""``kvscope serve --data-parallel-size N``: N replicas and the router, one command.

Each replica is a ``kvscope serve`` child process on loopback with its own event stream
(free ports chosen at start and kept across restarts; with ``--events`` naming a base
port, replica i publishes on base + 2i, its snapshot endpoint on base + 2i + 1), given
``cpu_count // N`` CPU threads
(OMP_NUM_THREADS) or, on CUDA, one GPU each (CUDA_VISIBLE_DEVICES). The router runs in
this process on ``--host``/``--port``. A replica that dies is restarted on the same ports
(the router sees the new epoch and resyncs); SIGINT/SIGTERM drains every replica and
stops the router.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

READY = re.compile(r"ready on (http://\S+) .*events (tcp://\S+) \(snapshot (tcp://[^)\s]+)\)")
START_TIMEOUT_S = 600
RESTART_DELAY_S = 1.0
# serve flags that stay with the front (the router) and are not passed to the replicas
FRONT_ONLY = {"host", "port", "events", "events_keys", "record", "data_parallel_size",
              "routing_policy", "load_cost_tokens", "func", "command",
              "model_tag"}  # the positional MODEL: already folded into --model


@dataclass
class Child:
    index: int
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    url: str = ""
    events: str = ""
    snapshot: str = ""
    ready: threading.Event = field(default_factory=threading.Event)
    restarts: int = 0
    quiet: bool = False  # do not echo its output
    ready_re: str = ""  # a regex with one group, the URL (default: a replica's ready line)

    def launch(self) -> None:
        self.ready.clear()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **self.env},
                                     preexec_fn=_die_with_parent)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        pattern = re.compile(self.ready_re) if self.ready_re else READY
        for line in proc.stdout:
            m = pattern.search(line)
            if m and not self.ready.is_set():
                if self.ready_re:
                    self.url = m.group(1)
                else:
                    self.url, self.events, self.snapshot = m.groups()
                self.ready.set()
            if not self.quiet:
                print(f"[replica r{self.index}] {line}", end="", file=sys.stderr, flush=True)
        self.ready.set()


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it when the front dies, however it dies (Linux's
    PR_SET_PDEATHSIG), so that no replica outlives a killed front."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def replica_argv(args: argparse.Namespace) -> list[str]:
    """The `kvscope serve` command of one replica: the same flags, except the front's own
    (the API key travels in the environment, never on a command line)."""
    argv = [sys.executable, "-m", "kvscope.engine.cli", "serve"]
    for key, value in vars(args).items():
        if key in FRONT_ONLY or key == "api_key" or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_pair() -> int:
    """A port P with P and P + 1 both free (an event stream and its snapshot endpoint)."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise OSError("no free pair of loopback ports")


def _gpu_count(device: str) -> int:
    if device not in ("auto", "cuda") and not device.startswith("cuda"):
        return 0
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def run_data_parallel(args: argparse.Namespace) -> int:
    n = args.data_parallel_size
    base = _base_port(args.events)
    if base is False:
        print("kvscope serve: with --data-parallel-size, --events must be "
              "tcp://127.0.0.1:PORT (replica i uses PORT + 2i) or left out", file=sys.stderr)
        return 2
    gpus = _gpu_count(args.device)
    threads = max(1, (os.cpu_count() or 1) // n)
    children = []
    for i in range(n):
        # Fixed ports (not 0), so that a restarted replica is where the router looks.
        events = base + 2 * i if base else free_port_pair()
        argv = replica_argv(args) + [
            "--port", str(free_port()), "--events", f"tcp://127.0.0.1:{events}"]
        if args.record:
            stem, dot, ext = args.record.rpartition(".")
            argv += ["--record", f"{stem}.r{i}.{ext}" if dot else f"{args.record}.r{i}"]
        env = {"CUDA_VISIBLE_DEVICES": str(i % gpus)} if gpus else \
            {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        if args.api_key:
            env["KVSCOPE_API_KEY"] = args.api_key
        children.append(Child(i, argv, env))
    stopping = threading.Event()
    try:
        for c in children:  # all load at once
            c.launch()
        for c in children:
            c.ready.wait(START_TIMEOUT_S)
            if not c.url:
                print(f"kvscope serve: replica r{c.index} did not start (see its output "
                      "above)", file=sys.stderr)
                return 1
        return _serve_front(args, children, stopping, gpus, threads)
    finally:
        stopping.set()
        for c in children:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        for c in children:
            if c.proc is not None:
                try:
                    c.proc.wait(args.drain_timeout + 30)
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait()


def _base_port(events: str | None) -> int | None | bool:
    if events is None:
        return None
    m = re.fullmatch(r"tcp://127\.0\.0\.1:(\d+)", events)
    return int(m.group(1)) if m and int(m.group(1)) > 0 else False


def _supervise(children: list[Child], stopping: threading.Event) -> None:
    """Restart a replica that died (same ports), until we are stopping."""
    while not stopping.wait(0.5):
        for c in children:
            if c.proc is not None and c.proc.poll() is not None and not stopping.is_set():
                print(f"kvscope serve: replica r{c.index} exited ({c.proc.returncode}); "
                      "restarting it", file=sys.stderr, flush=True)
                time.sleep(RESTART_DELAY_S)
                c.restarts += 1
                c.launch()


def _serve_front(args: argparse.Namespace, children: list[Child], stopping: threading.Event,
                 gpus: int, threads: int) -> int:
    from kvscope.engine.router.build import build_router
    from kvscope.engine.router.serve import serve_router
    from kvscope.engine.server.daemon import bind_socket

    specs = [f"{c.url},{c.events},{c.snapshot}" for c in children]
    router, err = build_router(specs, args.routing_policy, args.load_cost_tokens, args.model,
                               args.chat_template)
    if router is None:
        print(f"kvscope serve: {err}", file=sys.stderr)
        return 2
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"kvscope serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]
    each = f"GPU {', '.join(str(i % gpus) for i in range(len(children)))}" if gpus else \
        f"{threads} CPU thread(s) each"
    line = (f"kvscope serve: ready on http://{host}:{port} (data parallel: "
            f"{len(children)} replicas, {each}, policy {args.routing_policy}; replicas "
            + "; ".join(f"r{c.index} {c.url} events {c.events}" for c in children) + ")")
    threading.Thread(target=_supervise, args=(children, stopping), daemon=True).start()
    try:
        asyncio.run(serve_router(router, sock, args.log_level, line))
    finally:
        stopping.set()
        sock.close()
    print("kvscope serve: stopped", file=sys.stderr, flush=True)
    return 0
