"""The request body of /v1/responses (OpenAI's Responses API), validated strictly and
translated onto a chat completion request: one path through the engine for both.

Stateless, as vLLM without its response store: a response is not kept, so
``previous_response_id``, ``conversation`` and ``background`` are refused with a 400 that
says to send the whole conversation as ``input`` (what the openai-agents SDK does by
default). The same compatibility policy as chat (protocol.py): honoured, accepted and
ignored (fields that cannot change what is generated), or refused naming the field.

The translation, item by item:
- ``instructions`` -> a system message first;
- ``input``: a string -> one user message; ``message`` items keep their role (text parts
  only); ``function_call`` items -> an assistant message's ``tool_calls`` (consecutive calls
  share one message); ``function_call_output`` -> a ``tool`` message;
- ``tools`` (flat function tools) -> chat's nested ``{"type": "function", "function": ...}``;
- ``text.format`` -> ``response_format``; ``max_output_tokens`` -> ``max_completion_tokens``;
- ``include: ["message.output_text.logprobs"]`` with ``top_logprobs`` -> chat's logprobs.
A 400 raised while the chat request is checked names the Responses field
(``responses_names``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from kvscope.engine.server.errors import APIError, bad_request
from kvscope.engine.server.protocol import ChatCompletionRequest
from kvscope.engine.server.strict import Strict

LOGPROBS_INCLUDE = "message.output_text.logprobs"

# chat's field -> the Responses field it came from (400s name what the client sent)
_CHAT_TO_RESPONSES = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                      "response_format": "text", "logprobs": "include"}


class _Other(BaseModel):
    """An item, part or tool of a type kvscope does not take: parsed only to be refused by
    name (``ResponsesRequest.unsupported``)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str


class TextPart(Strict):
    # output_text: an earlier answer sent back as input (with what the server sent along)
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _part_kind(v: Any) -> str:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return "text" if kind in ("input_text", "output_text") else "other"


Content = str | list[Annotated[Annotated[TextPart, Tag("text")] | Annotated[_Other, Tag("other")],
                               Discriminator(_part_kind)]]


def _text(content: Content) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text for p in content if isinstance(p, TextPart))


class MessageItem(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content
    # what the server put on an output message sent back as input; no effect
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(Strict):
    """An earlier call of one of the tools (sent back with its output)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: Content
    id: str | None = None
    status: str | None = None


_ITEM_TAGS = ("message", "function_call", "function_call_output")


def _item_kind(v: Any) -> str:
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", None)
    return kind if kind in _ITEM_TAGS else "other"


InputItem = Annotated[Annotated[MessageItem, Tag("message")]
                      | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[_Other, Tag("other")], Discriminator(_item_kind)]


class FunctionTool(Strict):
    """The Responses API's flat function tool."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # kvscope always holds the arguments to the schema


def _tool_kind(v: Any) -> str:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return "function" if kind == "function" else "other"


AnyTool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[_Other, Tag("other")],
                    Discriminator(_tool_kind)]


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema's
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class StreamOptions(Strict):
    include_obfuscation: bool | None = None  # padding against side channels; ignored


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    text: TextConfig | None = None
    tools: list[AnyTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | _Other | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    # accepted and ignored: they cannot change what is generated
    store: bool | None = None  # nothing is stored either way
    metadata: dict[str, str] | None = None  # echoed
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # refused unless empty (they need a response store or a reasoning model)
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    reasoning: dict[str, Any] | None = None

    def unsupported(self) -> None:
        stateless = ("kvscope does not store responses (stateless, as vLLM without its "
                     "response store): send the whole conversation as 'input'")
        if self.previous_response_id is not None:
            raise bad_request(f"'previous_response_id': {stateless}", "previous_response_id")
        if self.conversation is not None:
            raise bad_request(f"'conversation': {stateless}", "conversation")
        if self.background:
            raise bad_request(f"'background': {stateless}", "background")
        if self.prompt is not None:
            raise bad_request("'prompt' (a stored prompt template) is not supported by "
                              "kvscope; send the text as 'input'", "prompt")
        if self.reasoning and any(v not in (None, "none") for v in self.reasoning.values()):
            raise bad_request("'reasoning' is not supported by kvscope (no reasoning model)",
                              "reasoning")
        if self.truncation == "auto":
            raise bad_request("truncation 'auto' (dropping the conversation's start to fit "
                              "the context) is not supported by kvscope; an input longer "
                              "than the context is a 400", "truncation")
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise bad_request("'text.verbosity' is not supported by kvscope (only 'medium')",
                              "text")
        if isinstance(self.input, list) and not self.input:
            raise bad_request("'input' is empty", "input")
        for i, item in enumerate(self.input if isinstance(self.input, list) else ()):
            if isinstance(item, _Other):
                raise bad_request(f"input[{i}]: items of type '{item.type}' are not supported "
                                  "by kvscope (message, function_call, function_call_output)",
                                  "input")
            for part in item.content if isinstance(item, MessageItem) and \
                    isinstance(item.content, list) else ():
                if isinstance(part, _Other):
                    raise bad_request(f"input[{i}].content: parts of type '{part.type}' are "
                                      "not supported by kvscope (text only)", "input")
        for i, tool in enumerate(self.tools or ()):
            if isinstance(tool, _Other):
                raise bad_request(f"tools[{i}]: tools of type '{tool.type}' are not supported "
                                  "by kvscope (function tools only)", "tools")
        if isinstance(self.tool_choice, _Other):
            raise bad_request(f"tool_choice of type '{self.tool_choice.type}' is not supported "
                              "by kvscope", "tool_choice")
        if self.max_tool_calls is not None and self.max_tool_calls < 1:
            raise bad_request(f"'max_tool_calls' must be >= 1, got {self.max_tool_calls}",
                              "max_tool_calls")

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ())

    def messages(self) -> list[dict[str, Any]]:
        """The conversation as chat messages (see the module docstring)."""
        out: list[dict[str, Any]] = []
        if self.instructions is not None:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, MessageItem):
                out.append({"role": item.role, "content": _text(item.content)})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                prev = out[-1] if out else None
                if prev is not None and prev["role"] == "assistant" and prev.get("tool_calls"):
                    prev["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                out.append({"role": "tool", "tool_call_id": item.call_id,
                            "content": _text(item.output)})
        return out

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as a chat completion (checked, as ``parse`` checks one)."""
        body: dict[str, Any] = {"model": self.model, "messages": self.messages(),
                                "stream": self.stream,
                                "max_completion_tokens": self.max_output_tokens,
                                "temperature": self.temperature, "top_p": self.top_p,
                                "parallel_tool_calls": self.parallel_tool_calls}
        if self.wants_logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise bad_request("text.format of type 'json_schema' needs 'schema'", "text")
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "response", "schema": fmt.schema_}}
        elif fmt is not None:
            body["response_format"] = {"type": fmt.type}
        if self.tools is not None:
            body["tools"] = [{"type": "function", "function": t.model_dump(
                exclude={"type"}, exclude_none=True)} for t in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            body["tool_choice"] = {"type": "function",
                                   "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        with responses_names():
            req = ChatCompletionRequest.model_validate(
                {k: v for k, v in body.items() if v is not None})
            req._max_tool_calls = self.max_tool_calls
            req.unsupported()
        return req

    def echo(self) -> dict[str, Any]:
        """The request's settings as a Response object repeats them."""
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "max_tool_calls": self.max_tool_calls,
            "metadata": self.metadata or {},
            "parallel_tool_calls": self.parallel_tool_calls is not False,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_logprobs": self.top_logprobs or 0,
            "tool_choice": (self.tool_choice.model_dump() if isinstance(
                self.tool_choice, FunctionChoice) else self.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in self.tools or ()],
            "text": {"format": (self.text.format.model_dump(by_alias=True, exclude_none=True)
                                if self.text is not None and self.text.format is not None
                                else {"type": "text"})},
            "truncation": "disabled",
            "background": False,
            "previous_response_id": None,
            "reasoning": None,
            "service_tier": "default",
            "user": self.user,
        }


def responses_field(chat_field: str) -> str:
    """The Responses API's name of a field of the chat request it translates to."""
    return _CHAT_TO_RESPONSES.get(chat_field, chat_field)


@contextmanager
def responses_names() -> Iterator[None]:
    """A 400 about the translated chat request names the Responses field instead."""
    try:
        yield
    except APIError as e:
        new = _CHAT_TO_RESPONSES.get(e.param or "")
        if new is not None:
            e.message = e.message.replace(f"'{e.param}'", f"'{new}'")
            e.param = new
        raise
