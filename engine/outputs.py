"""What generation returns, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One completion of a request. `token_ids` includes a final EOS/stop token when one
    ended the completion (its text does not). `logprobs`, when the request asked for them, holds
    per generated token a {token_id: logprob} map of the chosen token plus the top-k."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None  # "stop" | "length" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    def finished(self) -> bool:
        return self.finish_reason is not None

    def snapshot(self) -> CompletionOutput:
        """This completion as it is now, for a step's output: its own ``token_ids`` list
        (the engine goes on appending to the live one); ``logprobs`` is shared, and only
        ever grows, so its first ``len(token_ids)`` entries are this snapshot's."""
        return CompletionOutput(self.index, self.text, list(self.token_ids),
                                self.cumulative_logprob, self.logprobs, self.finish_reason,
                                self.stop_reason)


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic seconds) of one request's life."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_cache_write_tokens: int = 0  # prompt tokens written into the prefix cache
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean gap between output tokens after the first (None until finished)."""
        if self.finished_time is None or self.first_token_time is None or \
                self.num_generation_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generation_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None)
    # vLLM's: per prompt token {token_id: logprob} of it and the top-k; the first is None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Set when this request alone failed inside the engine (it is finished, its blocks
    # freed); other requests are unaffected.
    error: str | None = None
    error_is_constraint: bool = False  # that failure was its output constraint's
