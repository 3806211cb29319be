"""Turn a request body into the prompt token ids the replica will see: the same tokenizer
and chat template as ``kvscope serve`` (engine/server/chat_prompt.py), loaded without weights."""

from __future__ import annotations

import json
from typing import Any

from kvscope.engine.model.tokenizer import Tokenizer


def prompt_token_ids(tokenizer: Tokenizer | None, path: str, body: bytes) -> list[int] | None:
    """The first prompt's token ids, or None when the body cannot be read (the replica
    will answer with the error; the router only loses its prediction)."""
    if tokenizer is None:
        return None
    try:
        if path.endswith(("/chat/completions", "/responses")):
            from kvscope.engine.server.protocol import ChatCompletionRequest
            from kvscope.engine.server.responses_protocol import ResponsesRequest
            from kvscope.engine.server.strict import parse

            req = (parse(ChatCompletionRequest, body) if path.endswith("/chat/completions")
                   else parse(ResponsesRequest, body).chat_request())
            text = req.prompt_text(tokenizer)
            return tokenizer.encode(text, add_special_tokens=False)
        prompt: Any = json.loads(body).get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch: route by its first prompt
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return list(prompt)
    except Exception:  # noqa: BLE001 - any bad body: no prediction, the replica answers
        return None
    return None
