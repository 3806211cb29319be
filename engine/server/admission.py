"""What every endpoint checks before it asks the engine for anything: the API key, that
the server takes requests (not draining, engine alive), the body's size, the model's
name, a tokenizer where text needs one; and the two checks that need the model: a chat
prompt that renders through its template, an output constraint that compiles against its
tokenizer. Each refusal is an ``APIError`` and changes nothing in the engine."""

from __future__ import annotations

import asyncio
import hmac
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request

from kvscope.engine import structured
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.server.chat_prompt import ChatPrompt
from kvscope.engine.server.errors import APIError, bad_request, unavailable
from kvscope.engine.server.state import ServerState


def server_state(request: Request) -> ServerState:
    return request.app.state.kv


def authorize(state: ServerState, request: Request) -> None:
    key = state.settings.api_key
    if not key:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             key.encode()):
        raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                       type="authentication_error", code="invalid_api_key")


def admit(state: ServerState, request: Request) -> None:
    """A request that would run on the engine: authorized, and the engine takes it."""
    authorize(state, request)
    if state.draining:
        raise unavailable()
    if state.engine.failed is not None or not state.engine.alive:
        raise APIError(500, f"the engine has failed: {state.engine.failed}",
                       type="server_error", code="engine_failed")


async def read_body(state: ServerState, request: Request) -> bytes:
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


def check_model(state: ServerState, model: str | None) -> None:
    name = state.settings.served_model_name
    if model is not None and model != name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{name}'",
                       type="not_found_error", param="model", code="model_not_found")


def tokenizer(state: ServerState, param: str) -> Any:
    """The model's tokenizer, for text in the field ``param``."""
    if state.tokenizer is None:  # a dummy model (random weights): token ids only
        raise bad_request("this model has no tokenizer (a dummy model): send token ids to "
                          "/v1/completions", param)
    return state.tokenizer


# How much the tokenizer's normalizer may shrink a text before it splits it (accents
# stripped, ...): a prompt is refused unread only past this margin, when its bytes prove
# it is "obviously" too long.
SHRINK_ALLOWANCE = 4


def check_prompt_bytes(state: ServerState, text: str, param: str) -> None:
    """Refuse, before tokenizing it, a prompt whose length alone proves it exceeds the
    context: ``n`` bytes hold at least ``n / (max_token_bytes * SHRINK_ALLOWANCE)``
    tokens. The same 400 (context_length_exceeded) the token count would give."""
    limit = state.max_model_len * state.tokenizer.max_token_bytes * SHRINK_ALLOWANCE
    if len(text) <= limit // 4:  # a str's UTF-8 is at most 4 bytes a character
        return
    nbytes = len(text.encode("utf-8", "surrogatepass"))
    if nbytes > limit:
        raise APIError(400, f"This model's maximum context length is {state.max_model_len} "
                       f"tokens; the prompt's {nbytes} bytes hold more than that.",
                       param=param, code="context_length_exceeded")


# A prompt longer than this many characters a token of context is probed before it is
# tokenized whole: tokenizing a few MB costs seconds of CPU that the running streams need.
PROBE_CHARS_PER_TOKEN = 16
# The probe refuses only past twice the context: cutting a text can change how the tokens
# near the cut fall (a word split in two), never by a context's worth.
PROBE_MARGIN = 2


def check_prompt_length(state: ServerState, text: str, param: str) -> None:
    """Refuse a prompt that cannot fit the context, as cheaply as it can be proven: by its
    bytes (``check_prompt_bytes``), else, for a long text, by tokenizing only its first
    ``PROBE_CHARS_PER_TOKEN * max_model_len`` characters: more than ``PROBE_MARGIN`` times
    the context there proves the whole too long. A prompt the probe cannot judge is
    tokenized whole and its exact count decides (``limits``)."""
    check_prompt_bytes(state, text, param)
    probe = state.max_model_len * PROBE_CHARS_PER_TOKEN
    if len(text) <= probe:
        return
    n = len(state.tokenizer.encode(text[:probe], add_special_tokens=False))
    if n > state.max_model_len * PROBE_MARGIN:
        raise APIError(400, f"This model's maximum context length is {state.max_model_len} "
                       f"tokens; the prompt's first {probe} characters alone are {n} tokens.",
                       param=param, code="context_length_exceeded")


async def off_loop(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` on a worker thread: the CPU-bound parts of admission (parsing a large
    body, rendering a chat template, tokenizing) never pause the event loop, so every
    running stream keeps its pace while a heavy request is admitted."""
    return await asyncio.to_thread(fn, *args)


async def chat_tokens(state: ServerState, req: ChatPrompt) -> tuple[str, list[int]]:
    """The conversation's prompt text and token ids (off the event loop); an obviously
    oversized one is refused before tokenizing."""

    def run() -> tuple[str, list[int]]:
        text = chat_prompt(state, req)
        check_prompt_length(state, text, "messages")
        return text, state.tokenizer.encode(text, add_special_tokens=False)

    return await off_loop(run)


def chat_prompt(state: ServerState, req: ChatPrompt) -> str:
    """The conversation as the prompt text, through the model's chat template."""
    try:
        return req.prompt_text(tokenizer(state, "messages"))
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - a template error is the request's fault
        raise bad_request(f"cannot apply the chat template: {e}", "messages") from None


# Grammars compile on one thread of their own: a costly one (llguidance cannot be stopped
# once it runs) occupies one core, never all of them, and never the event loop.
_GRAMMAR_COMPILER = ThreadPoolExecutor(1, thread_name_prefix="kvscope-grammar")
COMPILE_POLL_S = 0.05


async def compile_constraint(state: ServerState, params: SamplingParams, field: str) -> None:
    """Compile the request's output constraint, if any, against the model's tokenizer:
    once (every completion of it starts from this compiled grammar; the same grammar
    again is found compiled), off the event loop; one that does not compile, is too
    large or takes over ``structured.MAX_COMPILE_S`` is a 400 naming ``field`` that never
    quotes it."""
    constraint = params.structured_outputs
    if constraint is None:
        return
    started: list[float] = []  # when the compiler thread took it up (queueing is free)

    def run() -> Any:
        started.append(time.monotonic())
        return constraint.compile(state.tokenizer)

    job = asyncio.get_running_loop().run_in_executor(_GRAMMAR_COMPILER, run)
    try:
        while not job.done():
            await asyncio.wait({job}, timeout=COMPILE_POLL_S)
            # the limit counts from when the compiler took it up, not the queueing
            if not job.done() and started and \
                    time.monotonic() - started[0] > structured.MAX_COMPILE_S:
                # left to finish (and be remembered): its outcome is nobody's to log
                job.add_done_callback(lambda f: f.cancelled() or f.exception())
                raise bad_request(structured.too_slow(), field)
        job.result()
    except ValueError as e:  # ConstraintError: a short message of its own
        raise bad_request(str(e), field) from None
