"""tool_choice "auto": the model decides whether to call a tool, in its own family's
syntax, and a parser reads the calls out of its answer (vLLM's ``--enable-auto-tool-choice
--tool-call-parser NAME``; the same names and formats):

- ``hermes`` (Qwen2/2.5, Hermes, and most ChatML-template models trained on tools):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call, after
  optional text (the content);
- ``llama3_json`` (Llama 3.1+ with JSON tool calling): the whole answer is
  ``{"name": ..., "parameters": {...}}``, several separated by ``;``, optionally after
  ``<|python_tag|>``.

``parse(text)`` gives ``(content, calls)``, each call ``{"name", "arguments"}`` with the
arguments as JSON text; an answer whose calls do not all parse is plain content (nothing
is lost). Streamed (``AutoToolStream``), text goes out as content until it may be the
start of a call; from there it is held and decided at the end by ``parse``, so a streamed
answer is exactly the unstreamed one.
"""

from __future__ import annotations

import json
from typing import Any

Call = dict[str, str]  # {"name": ..., "arguments": JSON text}


def _call(obj: Any, args_key: str) -> Call:
    """A decoded call object -> Call; ValueError if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a call")
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text already
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("arguments are not an object")
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


class HermesParser:
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        at = text.find(self.START)
        if at < 0:
            return text, []
        calls, pos = [], at
        try:
            while pos >= 0:
                body_at = pos + len(self.START)
                end = text.find(self.END, body_at)
                body = text[body_at:] if end < 0 else text[body_at:end]  # unclosed: the last
                calls.append(_call(json.loads(body), "arguments"))
                pos = -1 if end < 0 else text.find(self.START, end)
        except ValueError:
            return text, []
        content = text[:at]
        return (content if content.strip() else None), calls

    def content_until(self, text: str) -> int:
        """How much of ``text`` is surely content, whatever follows: everything before
        a call's start tag, or before a tail that may become one; whitespace alone is
        held too (an answer that is only calls has no content)."""
        at = text.find(self.START)
        if at < 0:
            at = len(text)
            for k in range(min(len(self.START) - 1, len(text)), 0, -1):
                if self.START.startswith(text[-k:]):
                    at = len(text) - k
                    break
        return at if text[:at].strip() else 0


class Llama3JsonParser:
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        body = text.strip().removeprefix(self.TAG).lstrip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, pos = json.JSONDecoder(), [], 0
        try:
            while pos < len(body):
                obj, pos = decoder.raw_decode(body, pos)
                calls.append(_call(obj, "parameters"))
                rest = body[pos:].lstrip()
                if rest and not rest.startswith(";"):
                    raise ValueError("text after a call")
                pos = len(body) - len(rest.removeprefix(";").lstrip())
        except ValueError:
            return text, []
        return None, calls

    def content_until(self, text: str) -> int:
        """A call is the whole answer: content only once the first visible character says
        the answer is not one."""
        body = text.lstrip()
        if not body or body.startswith("{") or self.TAG.startswith(body[:len(self.TAG)]):
            return 0
        return len(text)


PARSERS: dict[str, Any] = {p.name: p for p in (HermesParser(), Llama3JsonParser())}


class AutoToolStream:
    """One streamed choice under tool_choice "auto" (see the module docstring)."""

    def __init__(self, parser: Any) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of text sent as content

    def feed(self, delta: str) -> str:
        """The content to send now."""
        self.text += delta
        upto = max(self.sent, self.parser.content_until(self.text))
        out, self.sent = self.text[self.sent:upto], upto
        return out

    def finish(self) -> tuple[str, list[Call]]:
        """The rest of the content and the calls, once the answer is complete."""
        content, calls = self.parser.parse(self.text)
        end = len(content) if content is not None and calls else (
            0 if calls else len(self.text))
        rest = self.text[self.sent:max(end, self.sent)]
        return rest, calls
