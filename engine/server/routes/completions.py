"""POST /v1/completions: OpenAI's text completions (a prompt or a batch of them, text or
token ids; n completions each), with vLLM's extensions (protocol.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvscope.engine.outputs import RequestOutput
from kvscope.engine.server import openai_format as fmt
from kvscope.engine.server import sse
from kvscope.engine.server.admission import (
    admit,
    check_model,
    check_prompt_length,
    compile_constraint,
    off_loop,
    read_body,
    server_state,
)
from kvscope.engine.server.errors import bad_request
from kvscope.engine.server.jobs import Job, collect, submit
from kvscope.engine.server.openapi import request_body
from kvscope.engine.server.protocol import CompletionRequest
from kvscope.engine.server.state import ServerState
from kvscope.engine.server.strict import parse

router = APIRouter()


@router.post("/v1/completions", openapi_extra=request_body(CompletionRequest))
async def completions(request: Request) -> Response:
    state = server_state(request)
    admit(state, request)
    req: CompletionRequest = await off_loop(parse, CompletionRequest,
                                            await read_body(state, request))
    check_model(state, req.model)
    prompts = req.prompts()
    limits = state.limits
    limits.check_n(req.n * len(prompts))
    tokenized = await off_loop(lambda: [_tokenize(state, p) for p in prompts])
    params = [req.to_sampling_params(len(ids), limits) for _, ids in tokenized]
    await compile_constraint(state, params[0], req.structured_field)  # one for the batch
    job = await submit(state, "cmpl", tokenized, params)
    job.constraint_field = req.structured_field
    if req.stream:
        return sse.response(_stream(state, job, req), state, job)
    outs = await collect(state, request, job)
    return JSONResponse(_body(state, job, req, outs))


def _tokenize(state: ServerState, prompt: str | list[int]) -> tuple[str | None, list[int]]:
    """(text or None, token ids) of one prompt; a batch is checked whole before any of
    it reaches the engine. Runs off the event loop (``off_loop``)."""
    if isinstance(prompt, str):
        if state.tokenizer is None:
            raise bad_request("this model has no tokenizer (a dummy model): 'prompt' must be "
                              "token ids", "prompt")
        check_prompt_length(state, prompt, "prompt")
        ids = state.tokenizer.encode(prompt)
        if not ids:
            raise bad_request("'prompt' is empty", "prompt")
        return prompt, ids
    if not prompt:
        raise bad_request("'prompt' holds an empty token list", "prompt")
    if any(t < 0 or t >= state.vocab_size for t in prompt):
        raise bad_request(f"'prompt' token ids must be in [0, {state.vocab_size})", "prompt")
    return None, list(prompt)


def _body(state: ServerState, job: Job, req: CompletionRequest,
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


def _stream(state: ServerState, job: Job, req: CompletionRequest) -> AsyncIterator[str]:
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

    return sse.chunks(state, job, sse.stop_strings(req.stop), chunk, req.include_usage,
                      usage_chunk, req.continuous_usage)
