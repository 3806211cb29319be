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
  fields known to be harmless are listed above instead (strict.py).

A request becomes the engine's SamplingParams in one pass (``to_sampling_params``, as
vLLM's request models do it): the limits of the server and the model (limits.py) and
SamplingParams' own ranges are each checked once, there, and an error carries the field the
client sent (SamplingParamsError's ``param``, renamed to the request's vocabulary).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, PrivateAttr

from kvscope.engine.server import tools
from kvscope.engine.server.chat_prompt import ChatPrompt
from kvscope.engine.server.errors import bad_request
from kvscope.engine.server.limits import Limits
from kvscope.engine.server.strict import Strict
from kvscope.engine.structured import StructuredOutputsParams

if TYPE_CHECKING:  # types only: the request models stay free of the engine
    from kvscope.engine.sampling_params import SamplingParams


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk (guidellm sends it)
    include_obfuscation: bool | None = None  # OpenAI: padding against side channels; ignored


class JsonSchemaFormat(Strict):
    """OpenAI's ``response_format.json_schema``."""

    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # kvscope always holds the output to the schema


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(Strict):
    """OpenAI's ``tools[].function``."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # kvscope always holds the arguments to the schema


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


class StructuredOutputs(Strict):
    """vLLM's ``structured_outputs`` request field (one constraint)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


# Accepted and ignored: they do not change what is generated (README "Compatibility").
IGNORED = ("user", "store", "metadata", "service_tier", "reasoning_effort",
           "parallel_tool_calls", "prompt_cache_key", "safety_identifier")


class _Sampling(Strict):
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
    # read once, when the request is checked (``unsupported``, which ``parse`` calls)
    _checked: bool = PrivateAttr(default=False)
    _biases: dict[int, float] | None = PrivateAttr(default=None)
    _constraint: StructuredOutputsParams | None = PrivateAttr(default=None)
    # the field a 400 about the prompt names; SamplingParams' names the request calls
    # otherwise (to_sampling_params)
    PROMPT_FIELD: ClassVar[str] = "prompt"
    RENAMED: ClassVar[dict[str, str]] = {}

    def unsupported(self) -> None:
        """Refuse values the engine cannot honour rather than ignore them; read the logit
        biases and the output constraint (a malformed one is a 400 here, before the
        tokenizer)."""
        self._biases = self._token_biases()
        if self.functions:  # OpenAI's deprecated form; an empty list offers nothing
            raise bad_request("'functions' is not supported by kvscope; use 'tools'",
                              "functions")
        if self.function_call not in (None, "none"):
            raise bad_request("'function_call' is not supported by kvscope; use "
                              "'tool_choice'", "function_call")
        self.check_tools()
        self._constraint = self._structured()
        self._checked = True

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

    @property
    def structured_field(self) -> str:
        """The field the output constraint came from (a 400 about it names this one)."""
        if self.tool_choice_made is not None:
            return "tools"
        return "structured_outputs" if self.structured_outputs is not None \
            else "response_format"

    def _structured(self) -> StructuredOutputsParams | None:
        """The output constraint: OpenAI's ``response_format`` (json_object, json_schema) or
        vLLM's ``structured_outputs``; None for plain text. Whether it compiles against the
        model's tokenizer is the server's check (``StructuredOutputsParams.compile``)."""
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

    def _token_biases(self) -> dict[int, float] | None:
        """OpenAI's ``logit_bias`` (token ids as JSON object keys, so strings) by token id."""
        if not self.logit_bias:
            return None
        try:
            return {int(t): b for t, b in self.logit_bias.items()}
        except ValueError:
            raise bad_request("'logit_bias' keys must be token ids", "logit_bias") from None

    # ------------------------------------------------ what each endpoint says its own way
    def logprob_counts(self) -> dict[str, int | None]:
        """The request's logprob fields by name (the server's --max-logprobs caps each)."""
        return {"prompt_logprobs": self.prompt_logprobs}

    def engine_logprobs(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) as SamplingParams takes them."""
        raise NotImplementedError

    def budget(self) -> tuple[int | None, str]:
        """The completion budget asked for (None: the rest of the context) and its field."""
        raise NotImplementedError

    def to_sampling_params(self, prompt_len: int, limits: Limits) -> SamplingParams:
        """The engine's parameters for this request's prompt of ``prompt_len`` tokens, in
        one pass: the server's and the model's limits (``limits``) and SamplingParams' own
        ranges, each checked once, here; a value out of range is a 400 naming the field the
        client sent. OpenAI's defaults (temperature 1, top_p 1) are SamplingParams'. A
        response that is not streamed is built from each request's last output only, so
        the engine is asked for that one (no per-step copy of the tokens, no per-step
        delivery)."""
        from kvscope.engine.sampling_params import (
            RequestOutputKind,
            SamplingParams,
            SamplingParamsError,
        )

        assert self._checked, "a request is checked (strict.parse) before its parameters"
        limits.check_logprobs(self.logprob_counts())
        asked, budget_field = self.budget()
        max_tokens = limits.budget(asked, prompt_len, budget_field, self.PROMPT_FIELD)
        logprobs, prompt_logprobs = self.engine_logprobs()
        kw: dict[str, Any] = {
            "n": self.n, "max_tokens": max_tokens,
            "output_kind": RequestOutputKind.CUMULATIVE if self.stream
            else RequestOutputKind.FINAL_ONLY}
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
                    "logit_bias": self._biases, "structured_outputs": self._constraint}
        kw.update({k: v for k, v in optional.items() if v is not None})
        try:
            params = SamplingParams(**kw)
            params.check_vocabulary(limits.vocab_size)
        except SamplingParamsError as e:
            name = budget_field if e.param == "max_tokens" else \
                self.RENAMED.get(e.param, e.param)
            raise bad_request(f"'{name}' {e.problem}", name) from None
        return params

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

    def budget(self) -> tuple[int | None, str]:
        # max_tokens 0 with echo scores the prompt only: generate one token and drop it
        # (vLLM does the same; that token comes with the prefill, at no extra step)
        return (1 if self.prompt_only else self.max_tokens), "max_tokens"

    def engine_logprobs(self) -> tuple[int | None, int | None]:
        """Prompt logprobs the engine computes: vLLM's field, or ``logprobs`` for echo (a
        negative prompt_logprobs is passed on, for SamplingParams to refuse by name)."""
        wanted = [k for k in (self.prompt_logprobs,
                              self.logprobs if self.echo else None) if k is not None]
        prompt = None if not wanted else self.prompt_logprobs \
            if self.prompt_logprobs is not None and self.prompt_logprobs < 0 else max(wanted)
        return self.logprobs, prompt

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


class ChatCompletionRequest(_Sampling, ChatPrompt):
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    PROMPT_FIELD: ClassVar[str] = "messages"
    RENAMED: ClassVar[dict[str, str]] = {"logprobs": "top_logprobs"}

    def logprob_counts(self) -> dict[str, int | None]:
        return {"top_logprobs": self.top_logprobs, "prompt_logprobs": self.prompt_logprobs}

    def budget(self) -> tuple[int | None, str]:
        if self.max_tokens is not None:
            return self.max_tokens, "max_tokens"
        return self.max_completion_tokens, "max_completion_tokens"

    def engine_logprobs(self) -> tuple[int | None, int | None]:
        return ((self.top_logprobs or 0) if self.logprobs else None), None

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
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise bad_request("give max_tokens or max_completion_tokens, not both",
                              "max_completion_tokens")


class TokenizeCompletionRequest(Strict):
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


class DetokenizeRequest(Strict):
    """vLLM's POST /detokenize."""

    model: str | None = None
    tokens: list[int]
