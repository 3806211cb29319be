"""POST /v1/chat/completions: OpenAI's chat completions, function calling included
(tool_choice "required" or a named function held to the tools' schemas, tools.py; "auto"
read out of the answer by the server's tool-call parser, tool_parsers.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvscope.engine.outputs import RequestOutput
from kvscope.engine.server import openai_format as fmt
from kvscope.engine.server import sse, tools
from kvscope.engine.server.admission import (
    admit,
    chat_tokens,
    check_model,
    compile_constraint,
    off_loop,
    read_body,
    server_state,
)
from kvscope.engine.server.errors import bad_request
from kvscope.engine.server.jobs import Job, collect, submit
from kvscope.engine.server.openapi import request_body
from kvscope.engine.server.protocol import ChatCompletionRequest
from kvscope.engine.server.state import ServerState
from kvscope.engine.server.strict import parse
from kvscope.engine.server.tool_parsers import PARSERS, AutoToolStream

router = APIRouter()


@router.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
async def chat(request: Request) -> Response:
    state = server_state(request)
    admit(state, request)
    req: ChatCompletionRequest = await off_loop(parse, ChatCompletionRequest,
                                                await read_body(state, request))
    check_model(state, req.model)
    job = await submit_chat(state, req)
    if req.stream:
        return sse.response(_stream(state, job, req), state, job)
    outs = await collect(state, request, job)
    return JSONResponse(_body(state, job, req, outs))


async def submit_chat(state: ServerState, req: ChatCompletionRequest) -> Job:
    """Check a chat request against the server and model, render its prompt, submit it
    (also the Responses API's way in)."""
    if req.auto_tools and state.settings.tool_parser is None:
        raise bad_request("tool_choice 'auto' (the model decides whether to call; OpenAI's "
                          "default once tools are given) needs a server started with "
                          "--enable-auto-tool-choice --tool-call-parser NAME (vLLM's flags; "
                          "hermes or llama3_json, the model family's syntax); or send "
                          "tool_choice 'required', a named function or 'none'", "tool_choice")
    limits = state.limits
    limits.check_n(req.n)
    text, ids = await chat_tokens(state, req)
    params = req.to_sampling_params(len(ids), limits)
    await compile_constraint(state, params, req.structured_field)
    job = await submit(state, "chatcmpl", [(text, ids)], [params])
    job.constraint_field = req.structured_field
    return job


def auto_parser(state: ServerState, req: ChatCompletionRequest) -> Any:
    """The tool-call parser that reads this request's answer (tool_choice "auto"), or None."""
    return PARSERS[state.settings.tool_parser] if req.auto_tools else None


def _body(state: ServerState, job: Job, req: ChatCompletionRequest,
          outs: list[RequestOutput]) -> dict[str, Any]:
    text_of = fmt.TokenText(state.tokenizer)
    auto = auto_parser(state, req)
    choices = []
    for out in outs:
        for c in out.outputs:
            msg = _message(req, c.text, auto)
            choices.append({
                "index": c.index, "message": msg,
                "logprobs": (fmt.chat_logprobs(c, 0, len(c.token_ids), req.top_logprobs or 0,
                                               text_of) if req.logprobs else None),
                # OpenAI's reason when the model chose to call (tool_choice "auto")
                "finish_reason": "tool_calls" if auto is not None and msg.get("tool_calls")
                else c.finish_reason})
    return {"id": job.id, "object": "chat.completion", "created": int(time.time()),
            "model": state.settings.served_model_name, "choices": choices,
            "usage": fmt.usage(outs)}


def _message(req: ChatCompletionRequest, text: str,
             auto: Any = None) -> dict[str, Any]:
    """The answer as a chat message: its tool calls when the request made the model call
    one (content null, as OpenAI), else the text (also a tool call cut short). ``auto``:
    the tool-call parser of tool_choice "auto" (the content before the calls, and them)."""
    if auto is not None:
        content, calls = auto.parse(text)
        if not calls:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": content,
                "tool_calls": [tools.call(c["name"], c["arguments"]) for c in calls]}
    choice = req.tool_choice_made
    calls = tools.tool_calls(text, choice) if choice is not None else None
    if calls is None:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": None, "tool_calls": calls}


def _stream(state: ServerState, job: Job, req: ChatCompletionRequest) -> AsyncIterator[str]:
    text_of = fmt.TokenText(state.tokenizer)
    created = int(time.time())
    model = state.settings.served_model_name
    started: set[int] = set()
    made = req.tool_choice_made
    named = made if isinstance(made, dict) else None  # streams its arguments piece by piece
    required: dict[int, tools.RequiredCallStream] = {}  # "required": each call once closed
    parser = auto_parser(state, req)
    auto: dict[int, AutoToolStream] = {}  # "auto": content until it may be a call

    def chunk(choice: int, c: Any, text: str, t0: int, t1: int, done: bool) -> dict:
        delta: dict[str, Any] = {}
        first = choice not in started
        if first:  # OpenAI's first delta carries the role
            started.add(choice)
            delta["role"] = "assistant"
        if made == "required":
            calls = required.setdefault(choice, tools.RequiredCallStream())
            closed = calls.feed(text)
            if closed:
                delta["tool_calls"] = closed
            elif done and calls.count == 0:
                delta["content"] = calls.text  # cut short before any call closed
        elif parser is not None:
            stream = auto.setdefault(choice, AutoToolStream(parser))
            content = stream.feed(text)
            calls: list = []
            if done:
                rest, calls = stream.finish()
                content += rest
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = [{**tools.call(c["name"], c["arguments"]), "index": i}
                                       for i, c in enumerate(calls)]
        elif named is not None:
            # the call's id, type and name come first, then its arguments piece by piece
            piece: dict[str, Any] = {"index": 0, "function": {"arguments": text}}
            if first:
                piece = {**tools.call(named["name"], text), "index": 0}
            if text or first:
                delta["tool_calls"] = [piece]
        elif text or not done:
            delta["content"] = text
        lp = (fmt.chat_logprobs(c, t0, t1, req.top_logprobs or 0, text_of)
              if req.logprobs else None)
        reason = c.finish_reason if done else None
        if done and "tool_calls" in delta and parser is not None:
            reason = "tool_calls"  # OpenAI's reason when the model chose to call
        return {"id": job.id, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [{"index": choice, "delta": delta, "logprobs": lp,
                                             "finish_reason": reason}]}

    def usage_chunk(u: dict) -> dict:
        return {"id": job.id, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [], "usage": u}

    return sse.chunks(state, job, sse.stop_strings(req.stop), chunk, req.include_usage,
                      usage_chunk, req.continuous_usage)
