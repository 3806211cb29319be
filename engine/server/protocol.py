"""Request bodies of /v1/completions and /v1/chat/completions, validated strictly.

The compatibility policy (README "Compatibility"), field by field:
- honoured: OpenAI's sampling fields and vLLM's extensions that clients send (top_k,
  min_p, ignore_eos, min_tokens, stop_token_ids, prompt_logprobs, presence_penalty,
  frequency_penalty, repetition_penalty, logit_bias,
  stream_options.continuous_usage_stats, ...), structured outputs (response_format's
  json_object and json_schema, vLLM's structured_outputs: engine.structured), function
  calling with tool_choice "required" or a named function (engine.server.tools), and
  "auto" when the server has a tool-call parser (engine.server.tool_parsers).
- accepted and ignored (``IGNORED``): fields that do not change what is generated
  (store, metadata, service_tier, user, reasoning_effort, parallel_tool_calls unless
  tool_choice is "required", response_format of type "text").
- refused with a 400 naming the field: what would change the output and is not
  supported (suffix, best_of other than n, ...).
- unknown fields: a 400 too. Almost every field a client sends shapes the output, so a
  typo (``max_token``, ``temprature``) ignored silently would change behaviour; the
  fields known to be harmless are listed above instead.
A wrong JSON type (``"max_tokens": "5"``) is a 400 naming the field. Limits that depend on
the server (``--max-logprobs``, ``--max-n``) and the model (context) are checked here too,
before anything reaches the engine.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from engine.server import tools
from engine.server.errors import APIError, bad_request
from engine.structured import StructuredOutputsParams


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    def unsupported(self) -> None:
        """Refuse valid-typed values the server cannot honour (a 400 naming the field)."""


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk (guidellm sends it)
    include_obfuscation: bool | None = None  # OpenAI: padding against side channels; ignored


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``."""

    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # kvscope always holds the output to the schema


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(_Strict):
    """OpenAI's ``tools[].function``."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # kvscope always holds the arguments to the schema


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs`` request field (one constraint)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


# Accepted and ignored: they do not change what is generated (README "Compatibility").
IGNORED = ("user", "store", "metadata", "service_tier", "reasoning_effort",
           "parallel_tool_calls", "prompt_cache_key", "safety_identifier")


class _Sampling(_Strict):
    """Fields both endpoints share."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    # accepted and ignored (IGNORED)
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    parallel_tool_calls: bool | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = None
    # the Responses API's max_tool_calls (responses_protocol.py); chat has no such field
    _max_tool_calls: int | None = PrivateAttr(default=None)

    def unsupported(self) -> None:
        """Refuse values the engine cannot honour rather than ignore them."""
        if self.n < 1:
            raise bad_request(f"'n' must be >= 1, got {self.n}", "n")
        self.token_biases()  # keys that are not token ids: a 400 here
        if self.functions:  # OpenAI's deprecated form; an empty list offers nothing
            raise bad_request("'functions' is not supported by kvscope; use 'tools'",
                              "functions")
        if self.function_call not in (None, "none"):
            raise bad_request("'function_call' is not supported by kvscope; use "
                              "'tool_choice'", "function_call")
        self.check_tools()
        self.structured()  # a malformed constraint is a 400 here, before the tokenizer

    def check_tools(self) -> None:
        """Completions call no tools: only an empty list, or tool_choice "none"."""
        if self.tools:
            raise bad_request("'tools' needs /v1/chat/completions", "tools")
        if self.tool_choice not in (None, "none"):
            raise bad_request("'tool_choice' needs 'tools'", "tool_choice")

    @property
    def tool_choice_made(self) -> str | dict[str, Any] | None:
        """"required" or {"name": f} when the answer is a tool call, else None."""
        return None

    def structured(self) -> StructuredOutputsParams | None:
        """The output constraint: OpenAI's ``response_format`` (json_object, json_schema) or
        vLLM's ``structured_outputs``; None for plain text. Whether it compiles against the
        model's tokenizer is checked by the handler (``compile_grammar``)."""
        fmt, vllm = self.response_format, self.structured_outputs
        wants_format = fmt is not None and fmt.type != "text"
        choice = self.tool_choice_made
        if choice is not None:
            if wants_format or vllm is not None:
                raise bad_request("a tool call's arguments follow the tool's schema: give "
                                  "'tool_choice' or an output format, not both", "tool_choice")
            try:
                most = 1 if self.parallel_tool_calls is False else self._max_tool_calls
                return tools.constraint([t.function.model_dump() for t in self.tools], choice,
                                        max_calls=most)
            except ValueError as e:
                raise bad_request(str(e), "tools") from None
        if wants_format and vllm is not None:
            raise bad_request("give 'response_format' or 'structured_outputs', not both",
                              "structured_outputs")
        try:
            if wants_format:
                if fmt.type == "json_object":
                    return StructuredOutputsParams(json_object=True)
                if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                    raise bad_request("'response_format' of type 'json_schema' needs "
                                      "json_schema.schema", "response_format")
                return StructuredOutputsParams(json=fmt.json_schema.schema_)
            if vllm is not None:
                return StructuredOutputsParams(json=vllm.json_, regex=vllm.regex,
                                               choice=vllm.choice, grammar=vllm.grammar,
                                               json_object=bool(vllm.json_object))
        except ValueError as e:
            raise bad_request(str(e), "response_format" if wants_format
                              else "structured_outputs") from None
        return None

    def check_limits(self, max_logprobs: int, vocab_size: int) -> None:
        """Server and model limits of the sampling fields (each a 400 naming its field)."""
        for name, value in self.logprob_counts().items():
            if value is not None and not 0 <= value <= max_logprobs:
                raise bad_request(f"'{name}' must be in [0, {max_logprobs}] on this server "
                                  f"(--max-logprobs), got {value}", name)
        if self.top_k is not None and self.top_k < -1:
            raise bad_request(f"'top_k' must be -1, 0 (disabled) or >= 1, got {self.top_k}",
                              "top_k")
        biases = self.token_biases()
        if biases and not all(0 <= t < vocab_size for t in biases):
            raise bad_request(f"'logit_bias' token ids must lie in [0, {vocab_size})",
                              "logit_bias")
        if self.stop_token_ids and not all(0 <= t < vocab_size for t in self.stop_token_ids):
            raise bad_request(f"'stop_token_ids' must lie in [0, {vocab_size})",
                              "stop_token_ids")
        if self.min_tokens is not None and self.min_tokens < 0:
            raise bad_request(f"'min_tokens' must be >= 0, got {self.min_tokens}",
                              "min_tokens")

    def logprob_counts(self) -> dict[str, int | None]:
        return {"prompt_logprobs": self.prompt_logprobs}

    def token_biases(self) -> dict[int, float] | None:
        """OpenAI's ``logit_bias`` (token ids as JSON object keys, so strings) by token id."""
        if not self.logit_bias:
            return None
        try:
            return {int(t): b for t, b in self.logit_bias.items()}
        except ValueError:
            raise bad_request("'logit_bias' keys must be token ids", "logit_bias") from None

    def sampling_kwargs(self, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> dict[str, Any]:
        """SamplingParams keyword arguments (OpenAI defaults: temperature 1, top_p 1)."""
        kw: dict[str, Any] = {"n": self.n, "max_tokens": max_tokens}
        if self.min_tokens is not None:  # never past the budget the context leaves
            kw["min_tokens"] = min(self.min_tokens, max_tokens)
        optional = {"temperature": self.temperature, "top_p": self.top_p, "stop": self.stop,
                    "seed": self.seed, "top_k": self.top_k, "min_p": self.min_p,
                    "ignore_eos": self.ignore_eos, "stop_token_ids": self.stop_token_ids,
                    "skip_special_tokens": self.skip_special_tokens,
                    "include_stop_str_in_output": self.include_stop_str_in_output,
                    "logprobs": logprobs, "prompt_logprobs": prompt_logprobs,
                    "presence_penalty": self.presence_penalty,
                    "frequency_penalty": self.frequency_penalty,
                    "repetition_penalty": self.repetition_penalty,
                    "logit_bias": self.token_biases(),
                    "structured_outputs": self.structured()}
        kw.update({k: v for k, v in optional.items() if v is not None})
        return kw

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: usage in every chunk (needs include_usage)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    # chat's name for the same budget; guidellm sends both (equal) on completions
    max_completion_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def logprob_counts(self) -> dict[str, int | None]:
        return {"logprobs": self.logprobs, "prompt_logprobs": self.prompt_logprobs}

    @property
    def prompt_only(self) -> bool:
        """``max_tokens: 0`` with ``echo``: score the prompt, generate nothing."""
        return self.echo and self.max_tokens == 0

    def engine_prompt_logprobs(self) -> int | None:
        """Prompt logprobs the engine computes: vLLM's field, or ``logprobs`` for echo."""
        wanted = [k for k in (self.prompt_logprobs,
                              self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    def unsupported(self) -> None:
        super().unsupported()
        if self.max_completion_tokens is not None:
            if "max_tokens" in self.model_fields_set and \
                    self.max_tokens != self.max_completion_tokens:
                raise bad_request("'max_tokens' and 'max_completion_tokens' disagree; give "
                                  "one, or both equal", "max_completion_tokens")
            self.max_tokens = self.max_completion_tokens
        if self.suffix:
            raise bad_request("'suffix' is not supported by kvscope", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("'best_of' other than n is not supported by kvscope", "best_of")
        if self.echo and self.stream:
            raise bad_request("'echo' with 'stream' is not supported by kvscope", "echo")
        if self.prompt_logprobs is not None and self.stream:
            raise bad_request("'prompt_logprobs' with 'stream' is not supported by kvscope",
                              "prompt_logprobs")

    def prompts(self) -> list[str | list[int]]:
        """The batch: one string, one token list, or a list of either."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise bad_request("'prompt' is empty", "prompt")
        if isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class OtherPart(BaseModel):
    """A content part of another type (image_url, input_audio, file, ...): parsed only to be
    refused by name in ``ChatCompletionRequest.unsupported``."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | OtherPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


class ChatPrompt(_Strict):
    """A conversation and how it becomes a prompt: chat completions and /tokenize's chat
    form. vLLM's chat-template extras: end the prompt with the assistant's turn header
    (the default), or continue the final message as written (an assistant prefill)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: more variables for the template (e.g. Qwen3's {"enable_thinking": false})
    chat_template_kwargs: dict[str, Any] | None = None

    def unsupported(self) -> None:
        for i, m in enumerate(self.messages):
            for part in m.content if isinstance(m.content, list) else ():
                if isinstance(part, OtherPart):
                    raise bad_request(f"messages[{i}].content: parts of type '{part.type}' are "
                                      "not supported by kvscope (text only)", "messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("'continue_final_message' needs 'add_generation_prompt': false "
                              "(the final message is continued, no new turn is opened)",
                              "continue_final_message")
        taken = set(self.chat_template_kwargs or ()) & _TEMPLATE_OWN
        if taken:
            raise bad_request(f"chat_template_kwargs may not set {sorted(taken)} (the "
                              "request's own fields say those)", "chat_template_kwargs")
        if self.continue_final_message and not self.messages[-1].text():
            raise bad_request("'continue_final_message' needs a final message with text",
                              "continue_final_message")

    def conversation(self) -> list[dict[str, Any]]:
        # "developer" is OpenAI's newer name for the system role.
        out = []
        for m in self.messages:
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                       "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            out.append(tools.template_message(message))
        return out

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools shown to the model through the chat template (None: no tools)."""
        return None

    def prompt_text(self, tokenizer: Any) -> str:
        """The conversation through the model's chat template, as the engine's prompt.
        With ``continue_final_message`` the text ends where the final message's content
        does (its end-of-turn markup cut off), as transformers and vLLM do it: a marker
        appended to the content is rendered and cut at, and when the template trims the
        content (the marker's trailing space is gone) the cut is trimmed too. Template
        errors raise ValueError."""
        conv = self.conversation()
        if self.continue_final_message:
            conv[-1]["content"] += _CONTINUE_MARK
        shown = self.template_tools()
        text = tokenizer.apply_chat_template(conv, add_generation_prompt=self.add_generation_prompt,
                                             **(self.chat_template_kwargs or {}),
                                             **({"tools": shown} if shown else {}))
        if not self.continue_final_message:
            return text
        at = text.rfind(_CONTINUE_MARK.rstrip())
        if at < 0:
            raise ValueError("the chat template drops the final message's text, so it cannot "
                             "be continued")
        trimmed = not text.startswith(_CONTINUE_MARK, at)
        return text[:at].rstrip() if trimmed else text[:at]


class ChatCompletionRequest(_Sampling, ChatPrompt):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def logprob_counts(self) -> dict[str, int | None]:
        return {"top_logprobs": self.top_logprobs, "prompt_logprobs": self.prompt_logprobs}

    def check_tools(self) -> None:
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise bad_request("'tool_choice' needs 'tools'", "tool_choice")
            return
        names = [t.function.name for t in self.tools]
        if len(set(names)) != len(names):
            raise bad_request("two tools share a name", "tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not in "
                              "'tools'", "tool_choice")

    @property
    def tool_choice_made(self) -> str | dict[str, Any] | None:
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return {"name": self.tool_choice.function.name}
        return "required"

    @property
    def auto_tools(self) -> bool:
        """tool_choice "auto" (OpenAI's default once tools are given): the model decides,
        and the server's tool-call parser reads its calls (engine.server.tool_parsers)."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def template_tools(self) -> list[dict[str, Any]] | None:
        if self.tool_choice_made is None and not self.auto_tools:
            return None  # tool_choice "none": the model is not told about them
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def unsupported(self) -> None:
        _Sampling.unsupported(self)
        ChatPrompt.unsupported(self)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if self.prompt_logprobs is not None:
            raise bad_request("'prompt_logprobs' on chat is not supported by kvscope; use "
                              "/v1/completions", "prompt_logprobs")


class TokenizeCompletionRequest(_Strict):
    """vLLM's POST /tokenize, text form."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatPrompt):
    """vLLM's POST /tokenize, chat form (the prompt a chat completion would get)."""

    model: str | None = None
    add_special_tokens: bool = False  # the template holds them
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """vLLM's POST /detokenize."""

    model: str | None = None
    tokens: list[int]


# vLLM's removed guided-decoding fields: refused like any unknown field, saying where they went
_RENAMED = {f"guided_{k}": f"vLLM's old name; send \"structured_outputs\": {{\"{k}\": ...}}"
            for k in ("json", "regex", "choice", "grammar")}


# template variables the request's own fields set (chat_template_kwargs may not)
_TEMPLATE_OWN = {"messages", "add_generation_prompt", "tools", "bos_token", "eos_token",
                 "tokenize"}

# appended to a message to be continued, to find where its content ends once rendered
_CONTINUE_MARK = "KVSCOPE_CONTINUE_FINAL_MESSAGE "


def parse(model: type[_Strict], body: bytes) -> Any:
    """Validate a JSON body; any problem becomes a 400 naming the offending field."""
    try:
        req = model.model_validate_json(body)
    except ValidationError as e:
        raise refusal(e) from None
    req.unsupported()
    return req


def refusal(e: ValidationError) -> APIError:
    """A validation error as the 400 that names its field."""
    err = e.errors(include_url=False)[0]
    if err["type"] == "json_invalid":
        return bad_request(f"malformed JSON body: {err['msg']}", code="invalid_json")
    loc = [str(p) for p in err["loc"] if isinstance(p, (str, int))]
    param = loc[0] if loc else None
    if err["type"] == "extra_forbidden":
        hint = _RENAMED.get(".".join(loc))
        return bad_request(f"unrecognized request argument '{'.'.join(loc)}'"
                           + (f" ({hint})" if hint else ""), param)
    if err["type"] == "missing":
        return bad_request(f"missing required argument '{'.'.join(loc)}'", param)
    return bad_request(f"invalid '{param}': {err['msg']}"
                       + (f" (at {'.'.join(loc)})" if len(loc) > 1 else ""), param)


def check_max_tokens(max_tokens: int | None, prompt_len: int, max_model_len: int,
                     param: str, prompt_param: str = "prompt") -> int:
    """The completion budget; None means "the rest of the context", as vLLM does.
    Refuses a prompt that leaves no room and a budget past the context (OpenAI's 400).
    (``max_tokens: 0`` with echo is mapped to 1 by the caller, as vLLM does.)"""
    if prompt_len >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; "
                       f"the prompt has {prompt_len} (at least one must be generated).",
                       param=prompt_param,
                       code="context_length_exceeded")
    room = max_model_len - prompt_len
    if max_tokens is None:
        return room
    if max_tokens < 1:
        raise bad_request(f"'{param}' must be >= 1, got {max_tokens}", param)
    if max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, you requested {prompt_len + max_tokens} tokens "
                       f"({prompt_len} in the prompt, {max_tokens} in the completion).",
                       param=param, code="context_length_exceeded")
    return max_tokens
