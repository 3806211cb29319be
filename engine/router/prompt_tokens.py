"""Turn a request body into the prompt token ids the replica will see: the same tokenizer
and chat template as ``kvscope serve`` (engine/server/app.py), loaded without weights."""

from __future__ import annotations

import json
from typing import Any

from engine.model.tokenizer import Tokenizer


def load_tokenizer(model: str) -> Tokenizer | None:
    """The model's tokenizer only (a GGUF's metadata or an HF dir's tokenizer.json); None
    when the model has none (then the router routes by load alone)."""
    from engine.model.pull import resolve_model

    path = resolve_model(model)
    if path.is_dir():
        from engine.model.hf_loader import hf_config

        if not (path / "tokenizer.json").is_file():
            return None
        return Tokenizer.from_dir(path, hf_config(path).eos_token_ids)
    from engine.model.gguf_loader import gguf_tokenizer_metadata, open_gguf

    return Tokenizer.from_gguf_metadata(gguf_tokenizer_metadata(open_gguf(path), path),
                                        str(path))


def prompt_token_ids(tokenizer: Tokenizer | None, path: str, body: bytes) -> list[int] | None:
    """The first prompt's token ids, or None when the body cannot be read (the replica
    will answer with the error; the router only loses its prediction)."""
    if tokenizer is None:
        return None
    try:
        if path.endswith(("/chat/completions", "/responses")):
            from engine.server.protocol import ChatCompletionRequest, parse
            from engine.server.responses_protocol import ResponsesRequest

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
