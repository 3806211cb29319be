"""What this server and its model allow one request: set at start-up, checked at the
boundary (``protocol``'s ``to_sampling_params``), each a 400 naming the field the client
sent. The ranges every SamplingParams field has whoever calls the engine are
SamplingParams' own; only what depends on the server or the model is here."""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.engine.server.errors import APIError, bad_request


@dataclass(frozen=True)
class Limits:
    max_model_len: int  # prompt + completion tokens
    vocab_size: int
    max_n: int = 16  # completions per HTTP request (n x prompts): --max-n
    max_logprobs: int = 20  # logprobs / top_logprobs / prompt_logprobs: --max-logprobs

    def check_n(self, total: int) -> None:
        if total > self.max_n:
            raise bad_request(f"this request asks for {total} completions (n x prompts); "
                              f"the limit is {self.max_n}", "n")

    def check_logprobs(self, counts: dict[str, int | None]) -> None:
        """``counts``: the request's logprob fields by name (negatives are SamplingParams')."""
        for name, value in counts.items():
            if value is not None and value > self.max_logprobs:
                raise bad_request(f"'{name}' must be at most {self.max_logprobs} on this "
                                  f"server (--max-logprobs), got {value}", name)

    def budget(self, max_tokens: int | None, prompt_len: int, param: str,
               prompt_param: str) -> int:
        """The completion budget of a prompt of ``prompt_len`` tokens: ``max_tokens``, or
        the rest of the context when None (vLLM's default). A prompt that leaves no room
        and a budget past the context are OpenAI's context_length_exceeded; a budget below
        1 is passed on (SamplingParams refuses it)."""
        if prompt_len >= self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                           f"tokens; the prompt has {prompt_len} (at least one must be "
                           "generated).", param=prompt_param, code="context_length_exceeded")
        room = self.max_model_len - prompt_len
        if max_tokens is None:
            return room
        if max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} "
                           f"tokens. However, you requested {prompt_len + max_tokens} tokens "
                           f"({prompt_len} in the prompt, {max_tokens} in the completion).",
                           param=param, code="context_length_exceeded")
        return max_tokens
