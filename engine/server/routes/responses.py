"""POST /v1/responses: OpenAI's Responses API, stateless. The request runs as the chat
completion it translates to (responses_protocol.py) and is answered as a Response object
or its event stream (responses_format.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvscope.engine.outputs import RequestOutput
from kvscope.engine.server import openai_format as fmt
from kvscope.engine.server import responses_format as rfmt
from kvscope.engine.server import sse
from kvscope.engine.server.admission import admit, check_model, off_loop, read_body, server_state
from kvscope.engine.server.errors import APIError
from kvscope.engine.server.jobs import Job, abort_rest, collect, deltas
from kvscope.engine.server.openapi import request_body
from kvscope.engine.server.protocol import ChatCompletionRequest
from kvscope.engine.server.responses_protocol import (
    ResponsesRequest,
    responses_field,
    responses_names,
)
from kvscope.engine.server.routes.chat import auto_parser, submit_chat
from kvscope.engine.server.state import ServerState
from kvscope.engine.server.strict import parse

router = APIRouter()


@router.post("/v1/responses", openapi_extra=request_body(ResponsesRequest))
async def responses(request: Request) -> Response:
    state = server_state(request)
    admit(state, request)
    rreq: ResponsesRequest = await off_loop(parse, ResponsesRequest,
                                            await read_body(state, request))
    check_model(state, rreq.model)
    with responses_names():
        req = rreq.chat_request()
        job = await submit_chat(state, req)
    job.constraint_field = responses_field(req.structured_field)  # a 400 while generating
    shape = rfmt.ResponseShape(rreq.echo(), state.settings.served_model_name)
    if req.stream:
        return sse.response(_events(state, job, req, shape), state, job)
    outs = await collect(state, request, job)
    return JSONResponse(_body(state, req, shape, outs))


def _body(state: ServerState, req: ChatCompletionRequest, shape: rfmt.ResponseShape,
          outs: list[RequestOutput]) -> dict[str, Any]:
    c = outs[0].outputs[0]
    lps = (fmt.chat_logprobs(c, 0, len(c.token_ids), req.top_logprobs or 0,
                             fmt.TokenText(state.tokenizer))["content"]
           if req.logprobs else None)
    status = rfmt.status_of(c.finish_reason)
    return shape.body(status, rfmt.output_items(c.text, req.tool_choice_made, status, lps,
                                                auto_parser(state, req)),
                      usage=rfmt.usage(outs))


async def _events(state: ServerState, job: Job, req: ChatCompletionRequest,
                  shape: rfmt.ResponseShape) -> AsyncIterator[str]:
    """The Responses API's event stream (responses_format.ResponseEvents); no [DONE]."""
    events = rfmt.ResponseEvents(shape, req.tool_choice_made, auto_parser(state, req))
    text_of = fmt.TokenText(state.tokenizer)
    try:
        for e in events.start():
            yield e
        last = None
        try:
            async for _choice, c, text, t0, t1, _done in deltas(job, []):
                lps = (fmt.chat_logprobs(c, t0, t1, req.top_logprobs or 0, text_of)["content"]
                       if req.logprobs else None)
                for e in events.feed(text, lps):
                    yield e
                last = c
        except APIError as err:
            for e in events.fail(err):
                yield e
            return
        for e in events.finish(last.finish_reason if last else None,
                               rfmt.usage([job.last[r] for r in job.rids])):
            yield e
    finally:
        abort_rest(state, job)
