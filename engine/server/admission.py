"""What every endpoint checks before it asks the engine for anything: the API key, that
the server takes requests (not draining, engine alive), the body's size, the model's
name, a tokenizer where text needs one; and the two checks that need the model: a chat
prompt that renders through its template, an output constraint that compiles against its
tokenizer. Each refusal is an ``APIError`` and changes nothing in the engine."""

from __future__ import annotations

import asyncio
import hmac
from typing import Any

from fastapi import Request

from engine.sampling import SamplingParams
from engine.server.chat_prompt import ChatPrompt
from engine.server.errors import APIError, bad_request, unavailable
from engine.server.state import ServerState


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


def chat_prompt(state: ServerState, req: ChatPrompt) -> str:
    """The conversation as the prompt text, through the model's chat template."""
    try:
        return req.prompt_text(tokenizer(state, "messages"))
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - a template error is the request's fault
        raise bad_request(f"cannot apply the chat template: {e}", "messages") from None


async def compile_constraint(state: ServerState, params: SamplingParams, field: str) -> None:
    """Compile the request's output constraint, if any, against the model's tokenizer:
    once per request (every completion of it starts from this compiled grammar), off the
    event loop (a large schema takes a while); one that does not compile is a 400 naming
    ``field``."""
    constraint = params.structured_outputs
    if constraint is None:
        return
    try:
        await asyncio.to_thread(constraint.compile, state.tokenizer)
    except ValueError as e:
        raise bad_request(str(e), field) from None
