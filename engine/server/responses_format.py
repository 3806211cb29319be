"""Response objects and stream events of /v1/responses (OpenAI's Responses API), built
from the engine's output text (pure: no engine, no I/O).

One generated answer becomes the response's ``output``: a ``message`` item with one
``output_text`` part, or, when the request made the model call a tool (``tool_choice``
"required" or a named function), one ``function_call`` item per call; an answer cut short
before it was a complete call stays a message. ``finish_reason`` "length" makes the
response ``incomplete`` (reason ``max_output_tokens``).

Streamed (``ResponseEvents``), the events come in OpenAI's order, each with the next
``sequence_number``: ``response.created``, ``response.in_progress``, then per output item
``output_item.added`` ... ``output_item.done`` (a message: ``content_part.added``,
``output_text.delta``..., ``output_text.done``, ``content_part.done``; a call:
``function_call_arguments.delta``..., ``function_call_arguments.done``), and last
``response.completed``, ``response.incomplete`` or ``response.failed``, carrying the whole
response. Invariant: the final response's ``output`` equals the items of the
``output_item.done`` events, in order, and equals what the same request gets unstreamed.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from kvscope.engine.outputs import RequestOutput
from kvscope.engine.server import openai_format as fmt
from kvscope.engine.server import tools
from kvscope.engine.server.errors import APIError
from kvscope.engine.server.tool_parsers import AutoToolStream


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def usage(outs: list[RequestOutput]) -> dict[str, Any]:
    """Chat's usage (``openai_format.usage``) under the Responses API's names, with the
    prompt tokens each request wrote into the prefix cache (``cache_write_tokens``: new
    cache entries, whole blocks; a prompt found cached writes none)."""
    u = fmt.usage(outs)
    written = sum(o.metrics.num_cache_write_tokens for o in outs if o.metrics is not None)
    return {"input_tokens": u["prompt_tokens"],
            "input_tokens_details": {**u["prompt_tokens_details"],
                                     "cache_write_tokens": written},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u["total_tokens"]}


def message(item_id: str, text: str, status: str,
            logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": logprobs or []}]}


def function_call(item_id: str, call_id: str, name: str, arguments: str,
                  status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponseShape:
    """The response object of one request: its id, creation time and the settings it
    repeats (``ResponsesRequest.echo``)."""

    def __init__(self, echo: dict[str, Any], model: str) -> None:
        self.id = new_id("resp")
        self.created_at = int(time.time())
        self.echo = echo
        self.model = model

    def body(self, status: str, output: list[dict[str, Any]],
             usage: dict[str, Any] | None = None, error: dict[str, Any] | None = None
             ) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "model": self.model, "output": output,
                "error": error,
                "incomplete_details": ({"reason": "max_output_tokens"}
                                       if status == "incomplete" else None),
                "usage": usage, **self.echo}


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def output_items(text: str, made: str | dict[str, Any] | None, status: str,
                 logprobs: list[dict[str, Any]] | None = None, auto: Any = None
                 ) -> list[dict[str, Any]]:
    """The finished answer as output items (see the module docstring); ``auto``: the
    tool-call parser of tool_choice "auto" (its content, then its calls)."""
    if auto is not None:
        content, found = auto.parse(text)
        items = [message(new_id("msg"), content or "", status, logprobs)
                 ] if content is not None or not found else []
        return items + [function_call(new_id("fc"), new_id("call"), c["name"], c["arguments"],
                                      "completed") for c in found]
    calls = tools.tool_calls(text, made) if made is not None else None
    if calls is None:
        return [message(new_id("msg"), text, status, logprobs)]
    return [function_call(new_id("fc"), new_id("call"), c["function"]["name"],
                          c["function"]["arguments"], "completed") for c in calls]


class ResponseEvents:
    """The SSE events of one streamed response (see the module docstring). ``start``,
    then ``feed`` per piece of new text, then ``finish`` (or ``fail``); each returns the
    events to send, as SSE text. ``auto``: the tool-call parser of tool_choice "auto"
    (content streams until it may be a call; the calls follow the message at the end)."""

    def __init__(self, shape: ResponseShape, made: str | dict[str, Any] | None,
                 auto: Any = None) -> None:
        self.shape = shape
        self.made = made
        self.seq = 0
        self.output: list[dict[str, Any]] = []  # items done
        self.item: dict[str, Any] | None = None  # the item being streamed
        self.text = ""  # everything fed
        self.content = ""  # what went out as the message's text
        self.logprobs: list[dict[str, Any]] = []  # all of them (the message's, at the end)
        self.unsent_logprobs: list[dict[str, Any]] = []  # fed, not yet on a delta
        self.calls = tools.RequiredCallStream() if made == "required" else None
        self.auto = AutoToolStream(auto) if auto is not None else None

    def _event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, separators=(',', ':'))}\n\n"

    def _lifecycle(self, kind: str, status: str, **extra: Any) -> str:
        return self._event(kind, response=self.shape.body(status, list(self.output), **extra))

    def start(self) -> list[str]:
        out = [self._lifecycle("response.created", "in_progress"),
               self._lifecycle("response.in_progress", "in_progress")]
        if self.made is None and self.auto is None:
            out += self._open_message()
        elif isinstance(self.made, dict):  # a named function: its arguments stream
            out += self._open_call(self.made["name"])
        return out

    def feed(self, text: str, logprobs: list[dict[str, Any]] | None = None) -> list[str]:
        self.text += text
        self.logprobs += logprobs or []
        self.unsent_logprobs += logprobs or []
        if self.calls is not None:  # "required": each call whole, once its object closes
            out = []
            for c in self.calls.feed(text):
                fn = c["function"]
                out += self._open_call(fn["name"])
                out += self._call_delta(fn["arguments"])
                out += self._close("completed")
            return out
        if self.auto is not None:
            return self._text_delta(self.auto.feed(text))
        if self.item is not None and self.item["type"] == "function_call":
            return self._call_delta(text)
        return self._text_delta(text) if text or logprobs else []

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> list[str]:
        status = status_of(finish_reason)
        out, calls = [], []
        if self.auto is not None:
            rest, calls = self.auto.finish()
            out += self._text_delta(rest)
        elif self.calls is not None and self.calls.count == 0:
            # cut short before any call closed: the text is the answer, as unstreamed
            out += self._text_delta(self.calls.text)
        if self.item is None and not calls and not self.output:
            out += self._open_message()  # an empty answer is still a message
        if self.item is not None:
            if self.item["type"] == "function_call":
                complete = self.made is not None and tools.tool_calls(self.text,
                                                                     self.made) is not None
                out += self._close("completed" if complete else "incomplete")
            else:
                out += self._close(status)
        for c in calls:  # tool_choice "auto": the calls after the message
            out += self._open_call(c["name"])
            out += self._call_delta(c["arguments"])
            out += self._close("completed")
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        out.append(self._lifecycle(kind, status, usage=usage))
        return out

    def fail(self, err: APIError) -> list[str]:
        return [self._lifecycle("response.failed", "failed",
                                error={"code": err.code or err.type, "message": err.message})]

    # -------------------------------------------------------------- items
    def _text_delta(self, text: str) -> list[str]:
        """Message text (the message opens on its first text)."""
        if not text and (self.item is None or not self.unsent_logprobs):
            return []
        out = self._open_message() if self.item is None else []
        self.content += text
        lps, self.unsent_logprobs = self.unsent_logprobs, []
        return out + [self._event("response.output_text.delta", item_id=self.item["id"],
                                  output_index=len(self.output), content_index=0,
                                  delta=text, logprobs=lps)]

    def _open_message(self) -> list[str]:
        self.item = message(new_id("msg"), "", "in_progress")
        part = dict(self.item["content"][0])
        self.item["content"] = []
        return [self._event("response.output_item.added", output_index=len(self.output),
                            item=self.item),
                self._event("response.content_part.added", item_id=self.item["id"],
                            output_index=len(self.output), content_index=0, part=part)]

    def _open_call(self, name: str) -> list[str]:
        self.item = function_call(new_id("fc"), new_id("call"), name, "", "in_progress")
        return [self._event("response.output_item.added", output_index=len(self.output),
                            item=dict(self.item))]

    def _call_delta(self, text: str) -> list[str]:
        self.item["arguments"] += text
        return [self._event("response.function_call_arguments.delta", item_id=self.item["id"],
                            output_index=len(self.output), delta=text)] if text else []

    def _close(self, status: str) -> list[str]:
        item, index = self.item, len(self.output)
        out = []
        if item["type"] == "message":
            done = message(item["id"], self.content, status, self.logprobs)
            part = done["content"][0]
            out += [self._event("response.output_text.done", item_id=item["id"],
                                output_index=index, content_index=0, text=self.content,
                                logprobs=part["logprobs"]),
                    self._event("response.content_part.done", item_id=item["id"],
                                output_index=index, content_index=0, part=part)]
        else:
            done = {**item, "status": status}
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                   output_index=index, name=item["name"],
                                   arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=index, item=done))
        self.output.append(done)
        self.item = None
        return out
