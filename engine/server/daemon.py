"""Run the daemon: bind, load the engine, serve with uvicorn, drain on SIGINT/SIGTERM.

Order matters for a clear failure: the HTTP socket is bound first (a busy port fails in
a second, not after loading the model), then the engine is built (a bad flag is a
ValueError before any request), then uvicorn starts on the bound socket.

Drain (first SIGINT/SIGTERM): new requests get 503 and /health says "draining"; in-flight
requests run to completion for up to ``drain_timeout_s``, then the rest are aborted (their
clients get a 503 error, or an error event on a stream); uvicorn closes its connections;
the engine thread stops and closes the engine, which flushes the event stream and writes
the recording's index. A second signal skips the wait.

Engine fault (an exception escaping the engine step: kernel error, OOM): the engine loop
has already aborted every in-flight request with an error; the daemon then stops the
same way and exits with status 3, so a supervisor restarts it (a daemon that lives on
answering 500 helps nobody). A request that alone fails is no engine fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

EXIT_ENGINE_FAILED = 3
ANSWER_TIMEOUT_S = 5.0  # what the handlers of aborted requests get to tell their clients


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on (host, port); port 0 picks a free one."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def build_engine(factory: Callable[[Any], Any], config: Any) -> Any:
    """``factory(config)`` (the LLMEngine), run on a short-lived thread; its exception, if
    any, is raised here.

    Why not on the main thread: loading the model runs OpenMP regions, and a thread that
    ran one keeps its pool of OpenMP threads until it exits. The main thread never exits,
    so its pool would live beside the engine thread's own, and libgomp, once it manages
    more threads than there are CPUs, stops spinning at barriers: every barrier of every
    step then sleeps and wakes through the kernel. Measured on 2 cores (SmolLM2 fp32, a
    decode step of 4 sequences): 25-30 ms instead of 19-20 ms, the whole gap between the
    served and the offline step. Built here, the loader's pool ends with the loader, and the
    engine thread's team is the process's only one."""
    box: dict[str, Any] = {}

    def load() -> None:
        try:
            box["engine"] = factory(config)
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            box["error"] = e

    loader = threading.Thread(target=load, name="kvscope-load", daemon=True)
    loader.start()
    loader.join()
    if "error" in box:
        raise box["error"]
    return box["engine"]


def build_state(engine: Any, settings: Any) -> Any:
    """ServerState around a built engine: metrics, the engine loop (started)."""
    from kvscope.engine.server.engine_loop import EngineLoop
    from kvscope.engine.server.metrics import ServerMetrics
    from kvscope.engine.server.state import ServerState

    metrics = ServerMetrics(settings.served_model_name, prefix=settings.metrics_prefix)
    loop = EngineLoop(engine, on_step=metrics.on_step, on_finish=metrics.on_finish,
                      on_abort=metrics.on_abort)
    metrics.on_step(engine)
    if settings.chat_template is not None and engine.tokenizer is not None:
        engine.tokenizer.chat_template = settings.chat_template  # only the server renders chats
    if engine.tokenizer is not None:  # computed once here, not in the first request
        _ = engine.tokenizer.max_token_bytes
    loop.start()
    return ServerState(engine=loop, metrics=metrics, settings=settings,
                       tokenizer=engine.tokenizer, max_model_len=engine.max_model_len,
                       vocab_size=engine.model_config.vocab_size)


def _uvicorn_server(app: Any, log_level: str) -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        # Signals are ours (drain first); uvicorn must not install its own.
        @contextlib.contextmanager
        def capture_signals(self):  # noqa: ANN202
            yield

    config = uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug",
                            lifespan="off", timeout_graceful_shutdown=5,
                            timeout_keep_alive=5)
    return Server(config)


async def serve_forever(state: Any, sock: socket.socket, log_level: str = "warning",
                        ready_line: str = "") -> None:
    from kvscope.engine.server.app import create_app

    server = _uvicorn_server(create_app(state), log_level)
    stop = asyncio.Event()
    signals: list[int] = []
    aio = asyncio.get_running_loop()

    def on_signal(sig: int) -> None:
        signals.append(sig)
        stop.set()
        if len(signals) > 1:  # impatient: skip the drain wait
            state.engine.abort_all("shutdown")

    for sig in (signal.SIGINT, signal.SIGTERM):
        aio.add_signal_handler(sig, on_signal, sig)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if ready_line:
        print(ready_line, flush=True)
    stopper = asyncio.create_task(stop.wait())
    watcher = asyncio.create_task(_engine_failed(state))
    await asyncio.wait({task, stopper, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if watcher.done():
        print(f"kvscope serve: the engine failed ({state.engine.failed}); stopping",
              file=sys.stderr, flush=True)
        await answered(state)  # the handlers tell their clients the error
    watcher.cancel()
    await drain(state, signals)
    server.should_exit = True
    await task
    stopper.cancel()
    for sig in (signal.SIGINT, signal.SIGTERM):
        aio.remove_signal_handler(sig)


async def _engine_failed(state: Any) -> None:
    """Returns when the engine thread failed or died."""
    while state.engine.failed is None and state.engine.alive:
        await asyncio.sleep(0.1)


async def drain(state: Any, signals: list[int] | None = None) -> None:
    state.draining = True
    n = state.engine.num_inflight
    timeout = state.settings.drain_timeout_s
    if n:
        print(f"kvscope serve: draining {n} in-flight request(s), up to {timeout:g} s "
              "(signal again to abort them)", file=sys.stderr, flush=True)
    deadline = time.monotonic() + timeout
    first = len(signals or [])
    while state.engine.num_inflight and time.monotonic() < deadline and \
            len(signals or []) <= max(first, 1) and state.engine.alive:
        await asyncio.sleep(0.05)
    if state.engine.num_inflight:
        print(f"kvscope serve: aborting {state.engine.num_inflight} unfinished request(s)",
              file=sys.stderr, flush=True)
        state.engine.abort_all("shutdown")
        end = time.monotonic() + ANSWER_TIMEOUT_S
        while state.engine.num_inflight and time.monotonic() < end:
            await asyncio.sleep(0.02)
    await answered(state)  # every handler has sent its answer (a 503 for the aborted)


async def answered(state: Any) -> None:
    """Until every HTTP request in flight has had its answer sent (``state.answering``),
    for at most ANSWER_TIMEOUT_S: a client that stopped reading cannot hold the daemon."""
    end = time.monotonic() + ANSWER_TIMEOUT_S
    while state.answering and time.monotonic() < end:
        await asyncio.sleep(0.02)


def run_daemon(config: Any, settings: Any, host: str, port: int,
               log_level: str = "warning") -> int:
    """The whole life of ``kvscope serve``. Returns the process exit code."""
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sock = bind_socket(host, port)
    except OSError as e:
        print(f"kvscope serve: cannot listen on {host}:{port}: {e}", file=sys.stderr)
        return 1
    host_shown, port = sock.getsockname()[:2]
    try:
        from kvscope.engine.engine import LLMEngine
        from kvscope.engine.model.errors import ModelLoadError

        try:
            engine = build_engine(LLMEngine, config)
        except (ValueError, ModelLoadError, OSError) as e:
            # OSError: an event endpoint already bound, a recording path not writable
            print(f"kvscope serve: {e}", file=sys.stderr)
            return 2
        state = build_state(engine, settings)
        events = engine.events.endpoint if engine.events else None
        snap = engine.events.snapshot_endpoint if engine.events else None
        where = f"http://{host_shown}:{port}" if ":" not in host_shown \
            else f"http://[{host_shown}]:{port}"
        extras = [f"model {settings.served_model_name}",
                  f"{engine.cache_capacity_tokens // config.block_size} KV blocks "
                  f"x {config.block_size} tokens", f"max_model_len {engine.max_model_len}"]
        if events:
            extras.append(f"events {events} (snapshot {snap})")
        if config.record_path:
            extras.append(f"recording {config.record_path}")
        for pub in engine.events.consumers if engine.events else ():
            if hasattr(pub, "replay_endpoint"):  # engine.events.vllm.VllmPublisher
                replay = f" (replay {pub.replay_endpoint})" if pub.replay_endpoint else ""
                extras.append(f"vLLM KV events {pub.endpoint}{replay}")
        line = f"kvscope serve: ready on {where} ({'; '.join(extras)})"
        try:
            asyncio.run(serve_forever(state, sock, log_level, line))
        finally:
            state.engine.stop()
    finally:
        sock.close()
    print(stopped_line(config.record_path, getattr(state.engine.engine, "recording_error",
                                                   None)), file=sys.stderr, flush=True)
    if state.engine.failed is not None:
        print(f"kvscope serve: exiting with status {EXIT_ENGINE_FAILED}: the engine failed: "
              f"{state.engine.failed}", file=sys.stderr, flush=True)
        return EXIT_ENGINE_FAILED
    return 0


def stopped_line(record_path: str | None, recording_error: str | None) -> str:
    """The daemon's last line. It never claims a recording that was not finished: one
    that stopped early (a full disk) is named as such, with the reason."""
    msg = "kvscope serve: stopped"
    if record_path and recording_error is None:
        msg += f"; recording written to {record_path}"
    elif record_path:
        msg += (f"; the recording {record_path} stopped early ({recording_error}): it "
                "holds the steps before that, without its index")
    return msg
