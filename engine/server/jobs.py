"""One HTTP request's engine requests (a ``Job``: its prompts, n completions each) and
their way through the ``EngineClient``: submitted together or not at all, their outputs
collected from one asyncio queue, and aborted when the client leaves.

Invariant: when a job's handler is done (answered, failed or its client gone), none of
its requests is still running in the engine (``abort_rest`` runs in every exit path).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from kvscope.engine.outputs import CompletionOutput, RequestOutput
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.server import openai_format as fmt
from kvscope.engine.server.delivery import StepDelivery
from kvscope.engine.server.engine_client import Aborted, Delivery, EngineUnavailable
from kvscope.engine.server.errors import APIError, bad_request, unavailable
from kvscope.engine.server.state import ServerState

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks its client is there


@dataclass
class Job:
    id: str
    rids: list[str]
    prompt_texts: list[str | None]
    queue: asyncio.Queue
    n: int
    done: set[str] = field(default_factory=set)
    last: dict[str, RequestOutput] = field(default_factory=dict)
    constraint_field: str | None = None  # the request field holding its output constraint

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.rids)

    def usage(self) -> dict[str, Any]:
        return fmt.usage([self.last[r] for r in self.rids])


async def submit(state: ServerState, prefix: str,
                 tokenized: list[tuple[str | None, list[int]]],
                 params: list[SamplingParams]) -> Job:
    """Admit every prompt of the job (with its params), or none: a refusal aborts those
    admitted before it and is raised as the APIError the client gets."""
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    if state.delivery is None or state.delivery.loop is not loop:
        state.delivery = StepDelivery(loop)
    deliver = state.delivery.to(q)
    job_id = f"{prefix}-{uuid.uuid4().hex}"
    job = Job(job_id, [], [t for t, _ in tokenized], q, params[0].n)
    for k, ((_text, ids), p) in enumerate(zip(tokenized, params, strict=True)):
        rid = f"{job_id}-{k}"
        fut = state.engine.submit(rid, {"prompt_token_ids": ids}, p, deliver)
        try:
            await asyncio.wrap_future(fut)
        except Exception as e:  # noqa: BLE001 - refused: undo this job's earlier prompts
            for done in job.rids:
                state.engine.abort(done)
            if isinstance(e, EngineUnavailable):
                raise APIError(503, str(e), type="service_unavailable") from None
            if isinstance(e, ValueError | TypeError):
                raise bad_request(str(e), "prompt") from None
            raise APIError(500, f"the engine could not admit this request: "
                           f"{type(e).__name__}: {e}", type="server_error") from None
        job.rids.append(rid)
    return job


def take(job: Job, item: Delivery) -> RequestOutput:
    """Record one delivery; raise for an abort; return the output."""
    if isinstance(item, Aborted):
        job.done.add(item.request_id)
        if item.reason == "shutdown":
            raise unavailable("the server shut down before this request finished")
        if item.reason == "constraint":  # its grammar failed while generating: its fault
            raise bad_request(item.message, job.constraint_field)
        raise APIError(500, item.message or f"request aborted ({item.reason})",
                       type="server_error")
    job.last[item.request_id] = item
    if item.finished:
        job.done.add(item.request_id)
    return item


def abort_rest(state: ServerState, job: Job) -> None:
    for rid in job.rids:
        if rid not in job.done:
            state.engine.abort(rid)


async def collect(state: ServerState, request: Request, job: Job) -> list[RequestOutput]:
    """Wait for every request of the job; a client that leaves aborts them."""
    try:
        while not job.finished:
            try:
                item = await asyncio.wait_for(job.queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    break
                continue
            take(job, item)
    finally:
        abort_rest(state, job)
    return [job.last[r] for r in job.rids if r in job.last]


Delta = tuple[int, CompletionOutput, str, int, int, bool]


async def deltas(job: Job, stops: list[str]) -> AsyncIterator[Delta]:
    """Each choice's new text as it comes: (choice, output, text, first token, end token,
    finished); an aborted request raises its APIError."""
    tracker = fmt.DeltaTracker(stops)
    while not job.finished:
        out = take(job, await job.queue.get())
        k = job.rids.index(out.request_id)
        for c in out.outputs:
            choice = k * job.n + c.index
            d = tracker.delta(choice, c)
            if d is not None:
                yield (choice, c, *d)
