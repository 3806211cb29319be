"""EngineLoop: the one thread that owns the LLMEngine (which is not thread-safe); the
server's ``EngineClient`` (engine_client.py).

The HTTP side talks to it only through ``submit`` / ``abort`` / ``stop``, which put
commands on a queue; the thread applies them at step boundaries, so the HTTP side never
blocks the engine and the engine never blocks the HTTP side. Outputs go back through
the ``deliver`` callback given with each request (the server wraps an asyncio queue with
``loop.call_soon_threadsafe``). The thread sleeps on the command queue when the engine
has nothing to do.

Invariants: every submitted request gets exactly one terminal delivery: a finished
``RequestOutput``, or an ``Aborted`` (aborted by the client, by a drain, because it alone
failed inside a step, or because the engine failed), unless its ``submit`` future failed
(then it was never admitted). The hooks (metrics) of a step or a command batch run
before its deliveries: a client that sees its request end finds /metrics counting it.

Faults: an exception one request causes inside the step fails that request only (the
engine reports it as ``RequestOutput.error``; here it becomes ``Aborted(reason="error")``).
An exception escaping ``engine.step()`` is an engine fault: every in-flight request is
aborted with an error and ``failed`` is set; the daemon then exits non-zero so that a
supervisor restarts it, rather than living on answering 500.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kvscope.engine.outputs import RequestOutput
from kvscope.engine.server.engine_client import (
    Aborted,
    AbortReason,
    Deliver,
    Delivery,
    EngineUnavailable,
)

log = logging.getLogger(__name__)


class EngineLoop:
    """An ``EngineClient`` over a real engine (LLMEngine, or anything with its
    add_request / abort_request / step / has_unfinished_requests / close)."""

    def __init__(self, engine: Any, on_step: Callable[[Any], None] | None = None,
                 on_finish: Callable[[RequestOutput], None] | None = None,
                 on_abort: Callable[[str], None] | None = None) -> None:
        """``on_step(engine)`` runs after every step and every applied command batch;
        ``on_finish(output)`` for each finished request and ``on_abort(reason)`` for each
        aborted one (metrics hooks; all on the engine thread)."""
        self.engine = engine
        self._on_step = on_step or (lambda e: None)
        self._on_finish = on_finish or (lambda o: None)
        self._on_abort = on_abort or (lambda r: None)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._inflight: dict[str, Deliver] = {}  # engine thread only
        self._outbox: list[tuple[Deliver, Delivery]] = []  # engine thread: after the hooks
        self.num_inflight = 0  # mirrored for readers on other threads
        self.steps = 0
        self.failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvscope-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # ------------------------------------------------------------ any thread
    def submit(self, request_id: str, prompt: Any, params: Any,
               deliver: Deliver) -> concurrent.futures.Future:
        """Queue a request. The future resolves to None once the engine accepted it, or
        to the engine's ValueError/TypeError (state unchanged) if it refused it,
        EngineUnavailable when the engine is stopping or failed, or another exception
        (an engine bug in admitting this request; the engine keeps serving others)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", request_id, prompt, params, deliver, fut))
        return fut

    def abort(self, request_id: str, reason: AbortReason = "client") -> None:
        self._commands.put(("abort", request_id, reason))

    def abort_all(self, reason: AbortReason = "shutdown") -> None:
        self._commands.put(("abort_all", reason))

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is left, end the thread, close the engine (flushes the event stream
        and the recording). Idempotent."""
        if self._thread.is_alive():
            self._commands.put(("stop",))
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # ---------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            _use_engine_device(self.engine)
            while True:
                busy = self.failed is None and self.engine.has_unfinished_requests()
                commands = [] if busy else [self._commands.get()]  # idle: sleep here
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if any(c[0] == "stop" for c in commands):
                    for c in commands:  # refuse adds that raced the stop
                        if c[0] == "add":
                            c[5].set_exception(EngineUnavailable("the engine is stopping"))
                    self._abort_all("shutdown")
                    if self.failed is None:
                        self._step()  # publish the aborts' frees before closing
                    self._send()
                    return
                for c in commands:
                    self._apply(c)
                if any(c[0] != "add" for c in commands) and self.failed is None and \
                        not self.engine.has_unfinished_requests():
                    # An abort's frees wait in the event sink until a step closes the
                    # batch; with nothing left to run no step would, so run an empty one
                    # (schedules nothing, publishes the frees, keeps the recording whole).
                    self._step()
                if commands:
                    self._on_step(self.engine)
                self._send()
                if self.failed is None and self.engine.has_unfinished_requests():
                    self._step()
                    self._send()
        finally:
            self._send()  # nothing produced is kept back, even when the loop broke
            self.num_inflight = 0
            try:
                self.engine.close()
            except Exception:  # noqa: BLE001 - closing must not hide the real error
                log.exception("closing the engine failed")

    def _apply(self, c: tuple) -> None:
        kind = c[0]
        if kind == "add":
            _, rid, prompt, params, deliver, fut = c
            if self.failed is not None:
                fut.set_exception(EngineUnavailable(f"the engine failed: {self.failed}"))
                return
            try:
                self.engine.add_request(rid, prompt, params)
            except Exception as e:  # noqa: BLE001 - refuse this request, keep the engine
                if not isinstance(e, ValueError | TypeError):
                    log.exception("admitting %s failed", rid)
                fut.set_exception(e)
                return
            self._inflight[rid] = deliver
            self.num_inflight = len(self._inflight)
            fut.set_result(None)
        elif kind == "abort":
            self._abort(c[1], c[2])
        elif kind == "abort_all":
            self._abort_all(c[1])

    def _abort(self, rid: str, reason: str, message: str = "") -> None:
        deliver = self._inflight.pop(rid, None)
        if deliver is None:
            return  # finished meanwhile, or never admitted
        self.num_inflight = len(self._inflight)
        try:
            self.engine.abort_request(rid)
        except Exception:  # noqa: BLE001
            log.exception("aborting %s failed", rid)
        self._on_abort(reason)
        self._outbox.append((deliver, Aborted(rid, reason, message)))

    def _abort_all(self, reason: str, message: str = "") -> None:
        for rid in list(self._inflight):
            self._abort(rid, reason, message)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - an engine bug must not kill the daemon silently
            log.exception("engine step failed; aborting every in-flight request")
            self.failed = e
            self._abort_all("error", f"engine step failed: {e}")
            return
        self.steps += 1
        for out in outputs:
            deliver = self._inflight.get(out.request_id)
            if deliver is None:
                continue
            if out.finished:
                del self._inflight[out.request_id]
                self.num_inflight = len(self._inflight)
                if out.error is not None:  # it alone failed inside the step
                    reason = "constraint" if out.error_is_constraint else "error"
                    self._on_abort(reason)
                    self._outbox.append((deliver, Aborted(out.request_id, reason,
                                                          f"request failed: {out.error}")))
                    continue
                self._on_finish(out)
            self._outbox.append((deliver, out))
        self._on_step(self.engine)
        log.debug("step %d: %d outputs in %.3f s", self.steps, len(outputs),
                  time.perf_counter() - t0)


    def _send(self) -> None:
        """Hand out what the last step or command batch produced (its hooks have run)."""
        out, self._outbox = self._outbox, []
        for deliver, item in out:
            deliver(item)


def _use_engine_device(engine: Any) -> None:
    """Make the engine's CUDA device the engine thread's current one. A new thread starts
    on cuda:0, and Triton launches its kernels on the current device, not on the device of
    the tensors it is given (an engine on cuda:1 would launch on the wrong GPU)."""
    device = getattr(engine, "device", None)
    if getattr(device, "type", None) == "cuda" and device.index is not None:
        import torch

        torch.cuda.set_device(device)
