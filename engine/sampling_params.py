"""SamplingParams: what a request asks of sampling, with vLLM's names, defaults and
validation (torch-free: the router and the daemon's request parsing read it without torch).
``engine.sampling_ops`` holds the functions that apply it to logits; ``engine.sampler``
runs those over a step's rows."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any

from kvscope.engine.structured import StructuredOutputsParams


class SamplingParamsError(ValueError):
    """A SamplingParams field out of its range. ``param`` names the field (vLLM's name,
    which the HTTP request bodies share), ``problem`` says what is wrong with it: callers
    that speak another vocabulary (the server's request fields) name the field their way
    instead of reading it back out of the message."""

    def __init__(self, param: str, problem: str) -> None:
        super().__init__(f"SamplingParams: {param} {problem}")
        self.param = param
        self.problem = problem


class RequestOutputKind(IntEnum):
    """Which steps return a request's output (vLLM's enum and values). CUMULATIVE: every
    step that changed it, with everything so far; FINAL_ONLY: only the step it finishes
    (what ``LLM.generate`` needs: no per-step copy of every running request's tokens)."""

    CUMULATIVE = 0
    FINAL_ONLY = 2


@dataclass(init=False)
class SamplingParams:
    """temperature == 0 means greedy (top_k/top_p/min_p are then irrelevant). top_k <= 0 and
    top_p == 1 and min_p == 0 disable those filters. `logprobs` = k returns the chosen token's
    logprob plus the k most likely per step (raw logits, before temperature, as vLLM).
    `prompt_logprobs` = k returns, per prompt token after the first, its logprob given the
    tokens before it plus the k most likely (vLLM's; the first prompt token's entry is None).
    `min_tokens`: EOS and stop token ids cannot be sampled, and no stop rule applies, before
    that many tokens (vLLM's semantics). `structured_outputs`: the completion is constrained
    to a grammar (engine.structured). `logit_bias` ({token id: bias in [-100, 100]},
    OpenAI's) is added to those tokens' logits; then vLLM's penalties: `repetition_penalty`
    (1 = off) on every token of the prompt and the output so far, `frequency_penalty` and
    `presence_penalty` (0 = off, in [-2, 2]) on the output's (``adjust_logits``). They
    change what is sampled, not the logprobs reported (raw, as vLLM's default)."""

    n: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop: list[str]
    stop_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None
    min_tokens: int
    skip_special_tokens: bool
    include_stop_str_in_output: bool
    output_kind: RequestOutputKind
    structured_outputs: StructuredOutputsParams | None
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: dict[int, float] | None

    def __init__(self, **kwargs: Any) -> None:
        defaults: dict[str, Any] = {
            "n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None,
            "stop": None, "stop_token_ids": None, "max_tokens": 16, "ignore_eos": False,
            "logprobs": None, "prompt_logprobs": None, "min_tokens": 0,
            "skip_special_tokens": True, "include_stop_str_in_output": False,
            "output_kind": RequestOutputKind.CUMULATIVE, "structured_outputs": None,
            "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
            "logit_bias": None,
        }
        unknown = sorted(set(kwargs) - set(defaults))
        if unknown:
            raise TypeError(f"SamplingParams got unknown argument(s) {', '.join(unknown)}; "
                            f"accepted: {', '.join(defaults)}")
        values = defaults | kwargs
        stop = values["stop"]
        values["stop"] = [] if stop is None else [stop] if isinstance(stop, str) else list(stop)
        values["stop_token_ids"] = list(values["stop_token_ids"] or [])
        for name, value in values.items():
            setattr(self, name, value)
        self._validate()

    def _validate(self) -> None:
        def need(ok: bool, param: str, problem: str) -> None:
            if not ok:
                raise SamplingParamsError(param, problem)

        def is_int(x: Any) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        need(is_int(self.n) and self.n >= 1, "n", f"must be an int >= 1, got {self.n!r}")
        need(isinstance(self.temperature, int | float) and math.isfinite(self.temperature)
             and self.temperature >= 0, "temperature",
             f"must be >= 0 and finite, got {self.temperature!r}")
        need(isinstance(self.top_p, int | float) and 0 < self.top_p <= 1, "top_p",
             f"must be in (0, 1], got {self.top_p!r}")
        need(is_int(self.top_k), "top_k",
             f"must be an int (0 or -1 disables), got {self.top_k!r}")
        need(self.top_k >= -1, "top_k", f"must be -1, 0 (disabled) or >= 1, got {self.top_k}")
        need(isinstance(self.min_p, int | float) and 0 <= self.min_p <= 1, "min_p",
             f"must be in [0, 1], got {self.min_p!r}")
        need(self.seed is None or (is_int(self.seed) and -(2**63) <= self.seed < 2**64),
             "seed", f"must be an int in [-2**63, 2**64), got {self.seed!r}")
        need(is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens",
             f"must be an int >= 1, got {self.max_tokens!r}")
        need(all(isinstance(s, str) and s for s in self.stop), "stop",
             f"must be a non-empty string or a list of them, got {self.stop!r}")
        need(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             f"must be non-negative ints, got {self.stop_token_ids!r}")
        need(self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= 0),
             "logprobs", f"must be None or an int >= 0, got {self.logprobs!r}")
        need(self.prompt_logprobs is None
             or (is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0), "prompt_logprobs",
             f"must be None or an int >= 0, got {self.prompt_logprobs!r}")
        need(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"must be an int in [0, max_tokens], got {self.min_tokens!r}")
        need(isinstance(self.ignore_eos, bool), "ignore_eos",
             f"must be a bool, got {self.ignore_eos!r}")
        need(is_int(self.output_kind) and self.output_kind in set(RequestOutputKind),
             "output_kind", f"must be one of {[k.name for k in RequestOutputKind]}, got "
             f"{self.output_kind!r}")
        self.output_kind = RequestOutputKind(self.output_kind)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            need(isinstance(value, int | float) and not isinstance(value, bool)
                 and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        need(isinstance(self.repetition_penalty, int | float)
             and not isinstance(self.repetition_penalty, bool)
             and 0 < self.repetition_penalty < math.inf, "repetition_penalty",
             f"must be > 0 and finite (1: off), got {self.repetition_penalty!r}")
        need(self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
            is_int(t) and t >= 0 and isinstance(b, int | float) and not isinstance(b, bool)
            and -100 <= b <= 100 for t, b in self.logit_bias.items())), "logit_bias",
             f"must map token ids (ints >= 0) to biases in [-100, 100], got {self.logit_bias!r}")
        need(self.structured_outputs is None
             or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs", "must be None or a StructuredOutputsParams, got "
             f"{type(self.structured_outputs).__name__}")

    def check_vocabulary(self, vocab_size: int) -> None:
        """The fields that name tokens or count them, against a model's vocabulary (what
        ``_validate`` cannot know): logprobs and prompt_logprobs at most ``vocab_size``,
        logit_bias and stop_token_ids ids below it. Raises SamplingParamsError."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise SamplingParamsError(name, f"must be at most the vocabulary size "
                                                f"{vocab_size}, got {value}")
        for name, ids in (("logit_bias", self.logit_bias or ()),
                          ("stop_token_ids", self.stop_token_ids)):
            if ids and max(ids) >= vocab_size:
                raise SamplingParamsError(name, f"token ids must be below the vocabulary size "
                                                f"{vocab_size}, got {max(ids)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def adjusts_logits(self) -> bool:
        """A logit bias or a penalty: the sampler chooses from adjusted logits."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
