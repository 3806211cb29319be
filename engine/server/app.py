"""The daemon's HTTP API (FastAPI): OpenAI-compatible completions and chat, models,
health and Prometheus metrics, in front of one EngineLoop.

Every handler only validates, tokenizes and talks to the engine thread through the
EngineLoop's queue; outputs come back on a per-request asyncio queue. Errors are
OpenAI-shaped (``APIError``); a refused request changes nothing in the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.outputs import RequestOutput
from engine.sampling import RequestOutputKind, SamplingParams
from engine.server import openai_format as fmt
from engine.server import responses_format as rfmt
from engine.server import tools
from engine.server.delivery import StepDelivery
from engine.server.engine_loop import Aborted, EngineLoop, EngineUnavailable
from engine.server.errors import APIError, bad_request, unavailable
from engine.server.metrics import ServerMetrics
from engine.server.openapi import install as install_openapi
from engine.server.openapi import request_body
from engine.server.protocol import (
    ChatCompletionRequest,
    ChatPrompt,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    check_max_tokens,
    parse,
)
from engine.server.responses_protocol import ResponsesRequest, responses_names
from engine.server.tool_parsers import PARSERS, AutoToolStream
from engine.structured import compile_grammar

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks its client is there


@dataclass
class ServerSettings:
    served_model_name: str = "smollm2"
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    max_body_bytes: int = 4 << 20
    max_n: int = 16  # completions per request (n times the number of prompts)
    max_logprobs: int = 20  # logprobs / top_logprobs / prompt_logprobs (vLLM's default)
    drain_timeout_s: float = 30.0
    metrics_prefix: str = "kvscope"  # or "vllm": vLLM's metric names (server/metrics.py)
    # tool_choice "auto": the parser of the model family's tool-call syntax (tool_parsers;
    # vLLM's --enable-auto-tool-choice --tool-call-parser NAME); None refuses "auto"
    tool_parser: str | None = None
    chat_template: str | None = None  # --chat-template: replaces the model's own


@dataclass
class ServerState:
    loop: EngineLoop
    metrics: ServerMetrics
    settings: ServerSettings
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    delivery: StepDelivery | None = None  # of the running event loop, made on first use


@dataclass
class _Job:
    """One HTTP request's engine requests (a batch of prompts), their shared queue."""

    id: str
    rids: list[str]
    prompt_texts: list[str | None]
    queue: asyncio.Queue
    n: int
    done: set[str] = field(default_factory=set)
    last: dict[str, RequestOutput] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return len(self.done) == len(self.rids)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="kvscope", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.state.kv = state
    install_openapi(app, [CompletionRequest, ChatCompletionRequest, ResponsesRequest,
                          TokenizeCompletionRequest, DetokenizeRequest])

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                       type=kind)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        err = APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.loop.failed is not None or not state.loop.alive:
            return JSONResponse({"status": "failed", "error": str(state.loop.failed)}, 500)
        if state.draining:
            return JSONResponse({"status": "draining"}, 503)
        return JSONResponse({"status": "ok", "in_flight": state.loop.num_inflight})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _authorize(state, request)
        return JSONResponse({"object": "list", "data": [{
            "id": state.settings.served_model_name, "object": "model",
            "created": state.created, "owned_by": "kvscope",
            "max_model_len": state.max_model_len}]})

    @app.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        _admit(state, request)
        req: CompletionRequest = parse(CompletionRequest, await _read_body(state, request))
        _check_model(state, req.model)
        req.check_limits(state.settings.max_logprobs, state.vocab_size)
        prompts = req.prompts()
        _check_n(state, req.n * len(prompts))
        await _check_structured(state, req)
        tokenized = [_tokenize_completion(state, p) for p in prompts]
        # max_tokens 0 with echo scores the prompt only: generate one token and drop it
        # (vLLM does the same; that token comes with the prefill, at no extra step).
        budget = 1 if req.prompt_only else req.max_tokens
        params = [_params(req, check_max_tokens(budget, len(ids), state.max_model_len,
                                                "max_tokens"), req.logprobs,
                          req.engine_prompt_logprobs())
                  for _, ids in tokenized]
        job = await _submit(state, "cmpl", tokenized, params)
        if req.stream:
            return _sse(_stream_completion(state, request, job, req), state, job)
        outs = await _collect(state, request, job)
        return JSONResponse(_completion_body(state, job, req, outs))

    @app.post("/v1/chat/completions", openapi_extra=request_body(ChatCompletionRequest))
    async def chat(request: Request) -> Response:
        _admit(state, request)
        req: ChatCompletionRequest = parse(ChatCompletionRequest,
                                           await _read_body(state, request))
        _check_model(state, req.model)
        job = await _submit_chat(state, req)
        if req.stream:
            return _sse(_stream_chat(state, request, job, req), state, job)
        outs = await _collect(state, request, job)
        return JSONResponse(_chat_body(state, job, req, outs))

    @app.post("/v1/responses", openapi_extra=request_body(ResponsesRequest))
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, stateless: the request runs as the chat completion it
        translates to (responses_protocol.py) and is answered as a Response object or its
        event stream (responses_format.py)."""
        _admit(state, request)
        rreq: ResponsesRequest = parse(ResponsesRequest, await _read_body(state, request))
        _check_model(state, rreq.model)
        with responses_names():
            req = rreq.chat_request()
            job = await _submit_chat(state, req)
        shape = rfmt.ResponseShape(rreq.echo(), state.settings.served_model_name)
        if req.stream:
            return _sse(_stream_response(state, job, req, shape), state, job)
        outs = await _collect(state, request, job)
        return JSONResponse(_response_body(state, req, shape, outs))

    @app.post("/tokenize", openapi_extra=request_body(TokenizeCompletionRequest))
    async def tokenize(request: Request) -> JSONResponse:
        """vLLM's /tokenize: a text (``prompt``) or a conversation (``messages``, rendered
        as a chat completion would be) as the model's token ids."""
        _authorize(state, request)
        body = await _read_body(state, request)
        req = parse(TokenizeChatRequest if _has_messages(body) else TokenizeCompletionRequest,
                    body)
        _check_model(state, req.model)
        if isinstance(req, TokenizeChatRequest):
            text = _chat_prompt(state, req)
        else:
            text = req.prompt
            _tokenizer(state, "prompt")
        ids = state.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": state.max_model_len,
                             "tokens": ids,
                             "token_strs": state.tokenizer.convert_ids_to_tokens(ids)
                             if req.return_token_strs else None})

    @app.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
    async def detokenize(request: Request) -> JSONResponse:
        """vLLM's /detokenize: token ids as text, special tokens kept."""
        _authorize(state, request)
        req = parse(DetokenizeRequest, await _read_body(state, request))
        _check_model(state, req.model)
        _tokenizer(state, "tokens")
        if any(t < 0 or t >= state.vocab_size for t in req.tokens):
            raise bad_request(f"'tokens' must be in [0, {state.vocab_size})", "tokens")
        return JSONResponse({"prompt": state.tokenizer.decode(req.tokens,
                                                              skip_special_tokens=False)})

    return app


def _has_messages(body: bytes) -> bool:
    try:
        return "messages" in json.loads(body)
    except (ValueError, TypeError):
        return False  # the text form's parse reports it


def _tokenizer(state: ServerState, param: str) -> Any:
    if state.tokenizer is None:  # a dummy model (random weights): token ids only
        raise bad_request("this model has no tokenizer (a dummy model): send token ids to "
                          "/v1/completions", param)
    return state.tokenizer


def _chat_prompt(state: ServerState, req: ChatPrompt) -> str:
    """The conversation as the prompt text, through the model's chat template."""
    try:
        return req.prompt_text(_tokenizer(state, "messages"))
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - a template error is the request's fault
        raise bad_request(f"cannot apply the chat template: {e}", "messages") from None


# ------------------------------------------------------------------ checks
def _authorize(state: ServerState, request: Request) -> None:
    key = state.settings.api_key
    if not key:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             key.encode()):
        raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                       type="authentication_error", code="invalid_api_key")


def _admit(state: ServerState, request: Request) -> None:
    _authorize(state, request)
    if state.draining:
        raise unavailable()
    if state.loop.failed is not None or not state.loop.alive:
        raise APIError(500, f"the engine has failed: {state.loop.failed}", type="server_error",
                       code="engine_failed")


async def _read_body(state: ServerState, request: Request) -> bytes:
    limit = state.settings.max_body_bytes
    too_big = APIError(413, f"request body is larger than {limit} bytes",
                       code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("invalid Content-Length header")
        if int(declared) > limit:
            raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():  # also caps chunked bodies without a length
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _check_model(state: ServerState, model: str | None) -> None:
    name = state.settings.served_model_name
    if model is not None and model != name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{name}'",
                       type="not_found_error", param="model", code="model_not_found")


def _check_n(state: ServerState, total: int) -> None:
    if total > state.settings.max_n:
        raise bad_request(f"this request asks for {total} completions (n x prompts); "
                          f"the limit is {state.settings.max_n}", "n")


def _tokenize_completion(state: ServerState, prompt: str | list[int]) -> tuple[str | None,
                                                                               list[int]]:
    if isinstance(prompt, str):
        if state.tokenizer is None:
            raise bad_request("this model has no tokenizer (a dummy model): 'prompt' must be "
                              "token ids", "prompt")
        ids = state.tokenizer.encode(prompt)
        if not ids:
            raise bad_request("'prompt' is empty", "prompt")
        return prompt, ids
    if not prompt:
        raise bad_request("'prompt' holds an empty token list", "prompt")
    if any(t < 0 or t >= state.vocab_size for t in prompt):
        raise bad_request(f"'prompt' token ids must be in [0, {state.vocab_size})", "prompt")
    return None, list(prompt)


async def _check_structured(state: ServerState, req: Any) -> None:
    """An output constraint that does not compile against the model's tokenizer is a 400
    (compiled off the event loop: a large schema can take a while)."""
    constraint = req.structured()
    if constraint is None:
        return
    try:
        await asyncio.to_thread(compile_grammar, constraint, state.tokenizer)
    except ValueError as e:
        param = ("tools" if req.tool_choice_made is not None
                 else "structured_outputs" if req.structured_outputs is not None
                 else "response_format")
        raise bad_request(str(e), param) from None


async def _submit_chat(state: ServerState, req: ChatCompletionRequest) -> _Job:
    """Check a chat request against the server and model, render its prompt, submit it."""
    if req.auto_tools and state.settings.tool_parser is None:
        raise bad_request("tool_choice 'auto' (the model decides whether to call; OpenAI's "
                          "default once tools are given) needs a server started with "
                          "--enable-auto-tool-choice --tool-call-parser NAME (vLLM's flags; "
                          "hermes or llama3_json, the model family's syntax); or send "
                          "tool_choice 'required', a named function or 'none'", "tool_choice")
    req.check_limits(state.settings.max_logprobs, state.vocab_size)
    _check_n(state, req.n)
    text = _chat_prompt(state, req)
    ids = state.tokenizer.encode(text, add_special_tokens=False)
    await _check_structured(state, req)
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise bad_request("give max_tokens or max_completion_tokens, not both",
                          "max_completion_tokens")
    budget = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    param = "max_tokens" if req.max_tokens is not None else "max_completion_tokens"
    top = req.top_logprobs or 0
    params = _params(req, check_max_tokens(budget, len(ids), state.max_model_len, param,
                                           "messages"),
                     top if req.logprobs else None)
    return await _submit(state, "chatcmpl", [(text, ids)], [params])


def _auto_parser(state: ServerState, req: ChatCompletionRequest) -> Any:
    """The tool-call parser that reads this request's answer (tool_choice "auto"), or None."""
    return PARSERS[state.settings.tool_parser] if req.auto_tools else None


def _params(req: Any, max_tokens: int, logprobs: int | None,
            prompt_logprobs: int | None = None) -> SamplingParams:
    # A response that is not streamed is built from each request's last output only: ask
    # the engine for that one (no per-step copy of the tokens, no per-step delivery).
    kind = RequestOutputKind.CUMULATIVE if req.stream else RequestOutputKind.FINAL_ONLY
    try:
        return SamplingParams(**req.sampling_kwargs(max_tokens, logprobs, prompt_logprobs),
                              output_kind=kind)
    except (ValueError, TypeError) as e:
        msg = str(e).removeprefix("SamplingParams: ")
        param = msg.split(" ", 1)[0] if msg else None
        raise bad_request(msg, param if param in type(req).model_fields else None) from None


# ---------------------------------------------------------------- engine i/o
async def _submit(state: ServerState, prefix: str, tokenized: list[tuple[str | None, list[int]]],
                  params: list[SamplingParams]) -> _Job:
    loop = asyncio.get_running_loop()
    q: asyncio.Queue = asyncio.Queue()
    if state.delivery is None or state.delivery.loop is not loop:
        state.delivery = StepDelivery(loop)
    deliver = state.delivery.to(q)
    job_id = f"{prefix}-{uuid.uuid4().hex}"
    job = _Job(job_id, [], [t for t, _ in tokenized], q, params[0].n)
    for k, ((_text, ids), p) in enumerate(zip(tokenized, params, strict=True)):
        rid = f"{job_id}-{k}"
        fut = state.loop.submit(rid, {"prompt_token_ids": ids}, p, deliver)
        try:
            await asyncio.wrap_future(fut)
        except Exception as e:  # noqa: BLE001 - refused: undo this job's earlier prompts
            for done in job.rids:
                state.loop.abort(done)
            if isinstance(e, EngineUnavailable):
                raise APIError(503, str(e), type="service_unavailable") from None
            if isinstance(e, ValueError | TypeError):
                raise bad_request(str(e), "prompt") from None
            raise APIError(500, f"the engine could not admit this request: "
                           f"{type(e).__name__}: {e}", type="server_error") from None
        job.rids.append(rid)
    return job


def _take(job: _Job, item: Any) -> RequestOutput | None:
    """Record one delivery; raise for an abort; return the output."""
    if isinstance(item, Aborted):
        job.done.add(item.request_id)
        if item.reason == "shutdown":
            raise unavailable("the server shut down before this request finished")
        raise APIError(500, item.message or f"request aborted ({item.reason})",
                       type="server_error")
    job.last[item.request_id] = item
    if item.finished:
        job.done.add(item.request_id)
    return item


def _abort_rest(state: ServerState, job: _Job) -> None:
    for rid in job.rids:
        if rid not in job.done:
            state.loop.abort(rid)


async def _collect(state: ServerState, request: Request, job: _Job) -> list[RequestOutput]:
    """Wait for every request of the job; a client that leaves aborts them."""
    try:
        while not job.finished:
            try:
                item = await asyncio.wait_for(job.queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    break
                continue
            _take(job, item)
    finally:
        _abort_rest(state, job)
    return [job.last[r] for r in job.rids if r in job.last]


def _sse(gen: AsyncIterator[str], state: ServerState, job: _Job) -> StreamingResponse:
    # The background task aborts what is left even when the client hung up before the
    # stream's first iteration: Starlette then cancels the response without ever
    # starting (so never closing) the generator, whose own ``finally`` would not run.
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"},
                             background=BackgroundTask(_abort_rest, state, job))


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _deltas(job: _Job, stops: list[str]) -> AsyncIterator[tuple[int, Any, str, int,
                                                                     int, bool]]:
    """Each choice's new text as it comes: (choice, output, text, first token, end token,
    finished); an aborted request raises its APIError."""
    tracker = fmt.DeltaTracker(stops)
    while not job.finished:
        out = _take(job, await job.queue.get())
        k = job.rids.index(out.request_id)
        for c in out.outputs:
            choice = k * job.n + c.index
            d = tracker.delta(choice, c)
            if d is not None:
                yield (choice, c, *d)


async def _stream(state: ServerState, job: _Job, stops: list[str],
                  make_chunk: Any, include_usage: bool, usage_chunk: Any,
                  continuous_usage: bool = False) -> AsyncIterator[str]:
    """Shared SSE loop of completions and chat: deltas per choice, optional usage chunk,
    [DONE]. Leaving early (the client disconnected: Starlette cancels us) aborts what is
    left. With vLLM's ``continuous_usage`` every chunk also carries the usage so far."""
    try:
        try:
            async for choice, c, text, t0, t1, done in _deltas(job, stops):
                body = make_chunk(choice, c, text, t0, t1, done)
                if continuous_usage:
                    body["usage"] = fmt.usage(list(job.last.values()))
                yield _data(body)
        except APIError as e:
            yield _data(e.body())
        else:
            if include_usage:
                yield _data(usage_chunk(fmt.usage([job.last[r] for r in job.rids])))
        yield "data: [DONE]\n\n"
    finally:
        _abort_rest(state, job)


# --------------------------------------------------------------- completions
def _completion_body(state: ServerState, job: _Job, req: CompletionRequest,
                     outs: list[RequestOutput]) -> dict[str, Any]:
    text_of = fmt.TokenText(state.tokenizer)
    choices = []
    if req.prompt_only:  # the one token generated is not part of the answer
        outs = [fmt.without_generation(o) for o in outs]
    for k, out in enumerate(outs):
        prefix = ""
        if req.echo:
            prefix = job.prompt_texts[k] if job.prompt_texts[k] is not None else \
                state.tokenizer.decode(out.prompt_token_ids)
        for c in out.outputs:
            lp = None
            if req.logprobs is not None:
                lp = fmt.completion_logprobs(c, 0, len(c.token_ids), req.logprobs, text_of,
                                             len(prefix))
                if req.echo:  # the prompt's tokens first; the first has no logprob
                    lp = fmt.join_logprobs(fmt.prompt_completion_logprobs(
                        out, req.logprobs, text_of), lp)
            choice = {"index": k * job.n + c.index, "text": prefix + c.text, "logprobs": lp,
                      "finish_reason": c.finish_reason}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = fmt.vllm_prompt_logprobs(out, req.prompt_logprobs,
                                                                     text_of)
            choices.append(choice)
    choices.sort(key=lambda ch: ch["index"])
    return {"id": job.id, "object": "text_completion", "created": int(time.time()),
            "model": state.settings.served_model_name, "choices": choices,
            "usage": fmt.usage(outs)}


def _stream_completion(state: ServerState, request: Request, job: _Job,
                       req: CompletionRequest) -> AsyncIterator[str]:
    text_of = fmt.TokenText(state.tokenizer)
    created = int(time.time())
    model = state.settings.served_model_name

    next_offset: dict[int, int] = {}  # choice -> text_offset of its next streamed token

    def chunk(choice: int, c: Any, text: str, t0: int, t1: int, done: bool) -> dict:
        lp = None
        if req.logprobs is not None:
            lp = fmt.completion_logprobs(c, t0, t1, req.logprobs, text_of,
                                         next_offset.get(choice, 0))
            if lp["tokens"]:  # offsets run on across chunks, as in the non-streamed body
                next_offset[choice] = lp["text_offset"][-1] + len(lp["tokens"][-1])
        return {"id": job.id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": choice, "text": text, "logprobs": lp,
                             "finish_reason": c.finish_reason if done else None}]}

    def usage_chunk(u: dict) -> dict:
        return {"id": job.id, "object": "text_completion", "created": created, "model": model,
                "choices": [], "usage": u}

    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return _stream(state, job, stops, chunk, req.include_usage, usage_chunk,
                   req.continuous_usage)


# --------------------------------------------------------------------- chat
def _chat_body(state: ServerState, job: _Job, req: ChatCompletionRequest,
               outs: list[RequestOutput]) -> dict[str, Any]:
    text_of = fmt.TokenText(state.tokenizer)
    auto = _auto_parser(state, req)
    choices = []
    for out in outs:
        for c in out.outputs:
            msg = _chat_message(req, c.text, auto)
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


def _chat_message(req: ChatCompletionRequest, text: str, auto: Any = None) -> dict[str, Any]:
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


def _stream_chat(state: ServerState, request: Request, job: _Job,
                 req: ChatCompletionRequest) -> AsyncIterator[str]:
    text_of = fmt.TokenText(state.tokenizer)
    created = int(time.time())
    model = state.settings.served_model_name
    started: set[int] = set()
    made = req.tool_choice_made
    named = made if isinstance(made, dict) else None  # streams its arguments piece by piece
    required: dict[int, tools.RequiredCallStream] = {}  # "required": each call once closed
    parser = _auto_parser(state, req)
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

    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return _stream(state, job, stops, chunk, req.include_usage, usage_chunk,
                   req.continuous_usage)


# ---------------------------------------------------------------- responses
def _response_body(state: ServerState, req: ChatCompletionRequest, shape: rfmt.ResponseShape,
                   outs: list[RequestOutput]) -> dict[str, Any]:
    c = outs[0].outputs[0]
    lps = (fmt.chat_logprobs(c, 0, len(c.token_ids), req.top_logprobs or 0,
                             fmt.TokenText(state.tokenizer))["content"]
           if req.logprobs else None)
    status = rfmt.status_of(c.finish_reason)
    auto = _auto_parser(state, req)
    return shape.body(status, rfmt.output_items(c.text, req.tool_choice_made, status, lps,
                                                auto), usage=rfmt.usage(outs))


async def _stream_response(state: ServerState, job: _Job, req: ChatCompletionRequest,
                           shape: rfmt.ResponseShape) -> AsyncIterator[str]:
    """The Responses API's event stream (responses_format.ResponseEvents); no [DONE]."""
    events = rfmt.ResponseEvents(shape, req.tool_choice_made, _auto_parser(state, req))
    text_of = fmt.TokenText(state.tokenizer)
    try:
        for e in events.start():
            yield e
        last = None
        try:
            async for _choice, c, text, t0, t1, _done in _deltas(job, []):
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
        _abort_rest(state, job)
