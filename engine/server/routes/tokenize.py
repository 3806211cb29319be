"""vLLM's POST /tokenize and /detokenize: the model's own token ids of a text or of a
conversation rendered as a chat completion would render it, and back."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from kvscope.engine.server.admission import (
    authorize,
    chat_prompt,
    check_model,
    off_loop,
    read_body,
    server_state,
    tokenizer,
)
from kvscope.engine.server.errors import bad_request
from kvscope.engine.server.openapi import request_body
from kvscope.engine.server.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from kvscope.engine.server.strict import parse

router = APIRouter()


@router.post("/tokenize", openapi_extra=request_body(TokenizeCompletionRequest))
async def tokenize(request: Request) -> JSONResponse:
    """A text (``prompt``) or a conversation (``messages``) as the model's token ids."""
    state = server_state(request)
    authorize(state, request)
    body = await read_body(state, request)

    def run() -> dict:  # off the event loop: parsing, rendering, tokenizing
        req = parse(TokenizeChatRequest if _has_messages(body) else TokenizeCompletionRequest,
                    body)
        check_model(state, req.model)
        if isinstance(req, TokenizeChatRequest):
            text = chat_prompt(state, req)
        else:
            text = req.prompt
            tokenizer(state, "prompt")
        ids = state.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                "token_strs": state.tokenizer.convert_ids_to_tokens(ids)
                if req.return_token_strs else None}

    return JSONResponse(await off_loop(run))


@router.post("/detokenize", openapi_extra=request_body(DetokenizeRequest))
async def detokenize(request: Request) -> JSONResponse:
    """Token ids as text, special tokens kept."""
    state = server_state(request)
    authorize(state, request)
    req = parse(DetokenizeRequest, await read_body(state, request))
    check_model(state, req.model)
    tokenizer(state, "tokens")
    if any(t < 0 or t >= state.vocab_size for t in req.tokens):
        raise bad_request(f"'tokens' must be in [0, {state.vocab_size})", "tokens")
    return JSONResponse({"prompt": state.tokenizer.decode(req.tokens,
                                                          skip_special_tokens=False)})


def _has_messages(body: bytes) -> bool:
    try:
        return "messages" in json.loads(body)
    except (ValueError, TypeError):
        return False  # the text form's parse reports it
