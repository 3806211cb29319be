"""The seam between the HTTP side and the engine: what the server may ask of the thread
that owns the engine (``EngineClient``), and what comes back.

``EngineLoop`` (engine_loop.py) is the implementation that runs a real LLMEngine; the
tests' simulated engine (tests/server/doubles.py) is another. The HTTP handlers and the
daemon's drain use nothing else.

Contract, for every implementation: ``submit`` answers through its future (None once the
request is admitted; ValueError/TypeError when refused, nothing changed;
``EngineUnavailable`` when stopping or failed); an admitted request then gets its
outputs through ``deliver`` and exactly one terminal delivery: a finished
``RequestOutput`` or an ``Aborted``. ``deliver`` is called on the engine's thread.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from kvscope.engine.outputs import RequestOutput

# "constraint": the request's own output constraint failed inside the engine (its fault)
AbortReason = Literal["client", "shutdown", "error", "constraint"]


@dataclass(frozen=True)
class Aborted:
    """Terminal delivery of a request that did not finish: ``reason`` is "client"
    (the caller aborted it), "shutdown" (drain timeout), "error" (it failed inside the
    engine, alone or with the whole engine) or "constraint" (its structured-output
    constraint failed during generation: the request's fault, a 400)."""

    request_id: str
    reason: AbortReason
    message: str = ""


Delivery = RequestOutput | Aborted
Deliver = Callable[[Delivery], None]  # called on the engine's thread


class EngineUnavailable(RuntimeError):
    """The engine takes no more requests (stopping, or failed)."""


@runtime_checkable
class EngineClient(Protocol):
    """What the server talks to. ``failed`` (the exception that stopped the engine, or
    None), ``alive`` and ``num_inflight`` (admitted requests without their terminal
    delivery yet) may be read from any thread."""

    failed: BaseException | None
    num_inflight: int

    @property
    def alive(self) -> bool: ...

    def submit(self, request_id: str, prompt: dict[str, Any], params: Any,
               deliver: Deliver) -> concurrent.futures.Future: ...

    def abort(self, request_id: str, reason: AbortReason = "client") -> None: ...

    def abort_all(self, reason: AbortReason = "shutdown") -> None: ...

    def stop(self, timeout: float = 30.0) -> None: ...
