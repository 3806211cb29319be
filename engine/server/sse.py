"""Server-sent events: the streamed answers of completions and chat (OpenAI's chunks, an
optional usage chunk, ``[DONE]``), and the response that carries any event stream.

A stream that ends early (the client hung up: Starlette cancels it) aborts what is left
of its job; so does the response's background task, which runs even when the client
left before the stream's first iteration (Starlette then never starts, so never closes,
the generator, whose own ``finally`` would not run)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from kvscope.engine.outputs import CompletionOutput
from kvscope.engine.server import openai_format as fmt
from kvscope.engine.server.errors import APIError
from kvscope.engine.server.jobs import Job, abort_rest, deltas
from kvscope.engine.server.state import ServerState

# (choice, output, new text, first token, end token, finished) -> one chunk's body
MakeChunk = Callable[[int, CompletionOutput, str, int, int, bool], dict[str, Any]]


def response(events: AsyncIterator[str], state: ServerState, job: Job) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(abort_rest, state, job))


def data(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def chunks(state: ServerState, job: Job, stops: list[str], make_chunk: MakeChunk,
                 include_usage: bool, usage_chunk: Callable[[dict], dict],
                 continuous_usage: bool = False) -> AsyncIterator[str]:
    """The SSE loop completions and chat share: deltas per choice, an error event if the
    job was aborted, the usage chunk if asked for, [DONE]. With vLLM's
    ``continuous_usage`` every chunk also carries the usage so far."""
    try:
        try:
            async for choice, c, text, t0, t1, done in deltas(job, stops):
                body = make_chunk(choice, c, text, t0, t1, done)
                if continuous_usage:
                    body["usage"] = fmt.usage(list(job.last.values()))
                yield data(body)
        except APIError as e:
            yield data(e.body())
        else:
            if include_usage:
                yield data(usage_chunk(job.usage()))
        yield "data: [DONE]\n\n"
    finally:
        abort_rest(state, job)


def stop_strings(stop: str | list[str] | None) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])
