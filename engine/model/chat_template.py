"""Render a model's Jinja chat template the way transformers' apply_chat_template does:
a sandboxed environment with trim_blocks/lstrip_blocks, loop controls, `raise_exception`,
`strftime_now` and a non-HTML-escaping `tojson`, with the special tokens as variables."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                special_tokens: dict[str, str | None], **extra: Any) -> str:
    """Render one conversation. Raises ValueError for a message that is not a role/content dict."""
    for message in messages:
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"chat messages must be dicts with a 'role', got {message!r}")
    return _compile(template).render(messages=messages,
                                      add_generation_prompt=add_generation_prompt,
                                      **special_tokens, **extra)


def load_chat_template(arg: str) -> str:
    """vLLM's ``--chat-template``: a file's path, or the template itself. A template that
    does not compile, or an argument that names no file and holds no Jinja, is a
    ValueError saying which."""
    from pathlib import Path

    import jinja2

    path = Path(arg).expanduser()
    if path.is_file():
        template = path.read_text()
    elif any(mark in arg for mark in ("{{", "{%")):
        template = arg
    else:
        raise ValueError(f"--chat-template {arg!r}: no such file, and not a Jinja template")
    try:
        _compile(template)
    except jinja2.TemplateError as e:
        raise ValueError(f"--chat-template: the template does not compile: {e}") from None
    return template
