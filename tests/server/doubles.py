"""The test doubles of the server's seams, in one place (SGLang-style simulated engines):

- ``SimulatedEngine``: an ``EngineClient`` (engine/server/engine_client.py) without a model.
  Each request's answer is scripted; when it arrives is the test's call (``hold`` and
  ``release``), never the clock's; what reached it is recorded.
- ``ScriptedLLMEngine``: what ``EngineLoop`` drives (LLMEngine's add_request / step /
  abort_request / has_unfinished_requests / close, and the stats /metrics reads), one
  scripted token per request per step.
- ``CharTokenizer``: one token per character, with a chat template that shows the tools it
  is given, so a test can read what the model was shown.

Waits on a double are events with a hang guard (``HANG_S``), never a measure of speed.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvscope.engine.outputs import CompletionOutput, RequestOutput
from kvscope.engine.sampling_params import RequestOutputKind, SamplingParams
from kvscope.engine.server.engine_client import (
    Aborted,
    AbortReason,
    Deliver,
    EngineUnavailable,
)
from tests.waiting import HANG_S


@dataclass
class Submission:
    """A request that reached the engine."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


class SimulatedEngine:
    """An ``EngineClient`` whose every request answers ``pieces`` (one per step), ending
    with ``finish_reason``. With ``hold`` an admitted request waits until the test calls
    ``release``; else it runs to its end as it is submitted. Deliveries come from the
    thread that submits or releases (as EngineLoop's come from its own thread): through
    StepDelivery they reach the event loop the same way. ``refuse`` makes ``submit`` fail
    with that exception (as the engine's admission does)."""

    def __init__(self, pieces: list[str] | tuple[str, ...] = ("ok",), finish_reason: str = "stop",
                 *, hold: bool = False, refuse: Exception | None = None) -> None:
        self.pieces = list(pieces)
        self.finish_reason = finish_reason
        self.hold = hold
        self.refuse = refuse
        self.failed: BaseException | None = None
        self.num_inflight = 0
        self.submitted: list[Submission] = []
        self.aborts: list[tuple[str, AbortReason]] = []
        self._alive = True
        self._held: dict[str, tuple[Submission, Deliver]] = {}
        self._changed = threading.Condition()

    # ------------------------------------------------------------ EngineClient
    @property
    def alive(self) -> bool:
        return self._alive

    def submit(self, request_id: str, prompt: dict[str, Any], params: Any,
               deliver: Deliver) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self.failed is not None or not self._alive:
            fut.set_exception(EngineUnavailable(f"the engine failed: {self.failed}"))
            return fut
        if self.refuse is not None:
            fut.set_exception(self.refuse)
            return fut
        sub = Submission(request_id, list(prompt["prompt_token_ids"]), params)
        with self._changed:
            self.submitted.append(sub)
            self._held[request_id] = (sub, deliver)
            self.num_inflight = len(self._held)
            self._changed.notify_all()
        fut.set_result(None)
        if not self.hold:
            self.release(request_id)
        return fut

    def abort(self, request_id: str, reason: AbortReason = "client") -> None:
        with self._changed:
            held = self._held.pop(request_id, None)
            if held is None:
                return  # finished meanwhile, or never admitted
            self.num_inflight = len(self._held)
            self.aborts.append((request_id, reason))
            self._changed.notify_all()
        held[1](Aborted(request_id, reason))

    def abort_all(self, reason: AbortReason = "shutdown") -> None:
        for rid in list(self._held):
            self.abort(rid, reason)

    def stop(self, timeout: float = 30.0) -> None:
        self.abort_all("shutdown")
        self._alive = False

    # ------------------------------------------------------------ the test's controls
    def release(self, request_id: str) -> None:
        """Run a held request to its end: its outputs, then its terminal one."""
        with self._changed:
            sub, deliver = self._held.pop(request_id)
            self.num_inflight = len(self._held)
            self._changed.notify_all()
        for out in self.outputs(sub):
            deliver(out)

    def fail(self, error: BaseException) -> None:
        """An engine fault: every request in flight ends with an error, as EngineLoop's."""
        self.failed = error
        self.abort_all("error")

    def wait(self, condition: Callable[[SimulatedEngine], bool]) -> None:
        """Until ``condition(self)`` holds (checked at every submit, abort and release)."""
        with self._changed:
            assert self._changed.wait_for(lambda: condition(self), HANG_S), "the engine hung"

    def outputs(self, sub: Submission) -> list[RequestOutput]:
        """The scripted outputs of one request: every step's when streamed (CUMULATIVE),
        else the last only, as the engine sends them."""
        params, out = sub.params, []
        every = params.output_kind == RequestOutputKind.CUMULATIVE
        text = ""
        for k, piece in enumerate(self.pieces):
            text += piece
            last = k == len(self.pieces) - 1
            if last or every:
                reason = self.finish_reason if last else None
                outs = [CompletionOutput(i, text, list(range(k + 1)), None, None, reason)
                        for i in range(params.n)]
                out.append(RequestOutput(sub.request_id, None, sub.prompt_token_ids, outs,
                                         last))
        return out


class ScriptedLLMEngine:
    """What EngineLoop drives, without a model: each request gets one token per ``step``
    until ``tokens`` of them ("length"); ``fail_step`` makes the next step raise (an
    engine fault). It also answers what /metrics reads (``stats``, ``cache.metrics()``)."""

    def __init__(self, tokens: int = 3, device: Any = None) -> None:
        self.tokens = tokens
        self.device = device
        self.requests: dict[str, tuple[list[int], Any, list[int]]] = {}
        self.closed = False
        self.fail_step: BaseException | None = None
        self.stats: dict[str, Any] = {"running": 0, "waiting": 0, "decode_tokens": 0}
        self.cache = _CacheView()

    def add_request(self, request_id: str, prompt: dict[str, Any], params: Any) -> None:
        ids = list(prompt["prompt_token_ids"])
        if not ids:
            raise ValueError("prompt is empty")
        self.requests[request_id] = (ids, params, [])

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        if self.fail_step is not None:
            raise self.fail_step
        outs = []
        for rid, (ids, _params, done) in list(self.requests.items()):
            done.append(len(done))
            finished = len(done) >= self.tokens
            c = CompletionOutput(0, " t" * len(done), list(done), None, None,
                                 "length" if finished else None)
            outs.append(RequestOutput(rid, None, ids, [c], finished))
            if finished:
                del self.requests[rid]
        self.stats = {"running": len(self.requests), "waiting": 0,
                      "decode_tokens": len(outs)}
        return outs

    def close(self) -> None:
        self.closed = True


@dataclass
class _CacheView:
    """The cache manager's figures /metrics reads."""

    block_size: int = 16
    figures: dict[str, Any] = field(default_factory=lambda: {
        "tiers": {"gpu": {"total": 100, "used": 0}}, "prefix_query_tokens": 0,
        "prefix_hit_tokens": 0, "evictions": 0, "used_tokens": 0})

    def metrics(self) -> dict[str, Any]:
        return self.figures


class CharTokenizer:
    """One token per character; the template writes the tools it is given into the prompt
    (as a tool-aware chat template does), so a test can see what the model was shown."""

    eos_token_ids: list[int] = []
    max_token_bytes = 4  # one character, in UTF-8

    def apply_chat_template(self, conv: list[dict], add_generation_prompt: bool = True,
                            tools: list | None = None) -> str:
        head = f"<tools>{json.dumps(tools)}</tools>\n" if tools else ""
        return head + "".join(f"<{m['role']}>{m['content']}\n" for m in conv) + "<assistant>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 1000 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)
