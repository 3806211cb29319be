"""Function calling that works with any model: OpenAI's ``tool_choice`` "required" or a named
function, by holding the answer to the tools' parameter schemas (structured outputs, as vLLM
does it) and returning it as ``tool_calls``.

- named (``{"type": "function", "function": {"name": f}}``): the answer is f's arguments, a
  JSON value of f's ``parameters`` schema;
- "required": the answer is a JSON array of one or more ``{"name": ..., "parameters": ...}``
  objects, each naming one of the tools with arguments of its schema;
- "none": the tools are not shown to the model; a plain answer.
Streamed, a named function's arguments go out piece by piece, and "required" sends each call
whole once its object closes (``RequiredCallStream``).
"auto" (the model decides whether to call) is not held to anything: a parser of the model
family's own tool-call syntax reads the calls out of the answer (tool_parsers.py), when the
server was started with one.

Only plain data crosses this module's edge (the request models live in protocol.py).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from kvscope.engine.structured import StructuredOutputsParams

ANY_OBJECT = {"type": "object"}  # a function declared without parameters


def constraint(tools: list[dict[str, Any]], choice: str | dict[str, Any],
               max_calls: int | None = None) -> StructuredOutputsParams:
    """The output constraint of ``choice`` ("required" or a named function) over ``tools``
    (OpenAI's ``function`` objects: name, description, parameters); "required" makes at
    most ``max_calls`` calls (1 for OpenAI's ``parallel_tool_calls: false``)."""
    if choice == "required":
        calls = [{"type": "object", "additionalProperties": False,
                  "required": ["name", "parameters"],
                  "properties": {"name": {"const": t["name"]},
                                 "parameters": t.get("parameters") or ANY_OBJECT}}
                 for t in tools]
        most = {} if max_calls is None else {"maxItems": max_calls}
        return StructuredOutputsParams(json={"type": "array", "minItems": 1, **most,
                                             "items": {"anyOf": calls}})
    tool = next(t for t in tools if t["name"] == choice["name"])
    return StructuredOutputsParams(json=tool.get("parameters") or ANY_OBJECT)


def tool_calls(text: str, choice: str | dict[str, Any]) -> list[dict[str, Any]] | None:
    """The answer's ``tool_calls`` (OpenAI's shape, arguments as JSON text); None when the
    text is not a complete call (the answer was cut short): it is then returned as content."""
    if choice == "required":
        try:
            calls = json.loads(text)
        except ValueError:
            return None
        return [call(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                for c in calls]
    try:
        json.loads(text)
    except ValueError:
        return None
    return [call(choice["name"], text)]


def call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A conversation message as chat templates expect it: an assistant's earlier
    ``tool_calls`` with their JSON-text arguments parsed (templates iterate over them)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for c in calls:
        fn = dict(c.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass  # left as text; the template gets what the client sent
        parsed.append({**c, "function": fn})
    return {**message, "tool_calls": parsed}


class RequiredCallStream:
    """One streamed choice of a "required" answer: each call goes out as one
    ``tool_calls`` delta (id, name and whole arguments) as soon as its object is complete;
    ``text`` is everything received, for an answer cut short before any call closed."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # where the next call object may start
        self.count = 0
        self._decoder = json.JSONDecoder()

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        out = []
        while True:
            i = self.pos
            while i < len(self.text) and self.text[i] in "[, \n\r\t":
                i += 1
            if i >= len(self.text) or self.text[i] != "{":
                return out
            try:
                obj, end = self._decoder.raw_decode(self.text, i)
            except ValueError:  # not closed yet
                return out
            out.append({**call(obj["name"], json.dumps(obj["parameters"], ensure_ascii=False)),
                        "index": self.count})
            self.count += 1
            self.pos = end

