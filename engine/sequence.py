"""A sequence as the scheduler and the engine see it (torch-free).

One request with ``n`` samples becomes one sequence until its prompt is computed, then
``n - 1`` children are forked from it (sharing its blocks copy-on-write). Each sequence
carries its own progress: ``num_computed_tokens`` counts the tokens whose K/V are in the
cache; the tokens still to compute are ``all_token_ids[num_computed_tokens:]``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sequence:
    seq_id: str
    request_id: str
    index: int  # output index within the request (0..n-1)
    prompt_token_ids: list[int]
    params: Any  # engine.sampling_params.SamplingParams (untyped: no engine import here)
    priority: int = 0  # lower value runs first (vLLM's convention)
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    status: str = "waiting"  # waiting | running | finished
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    output_text: str = ""
    # metrics
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    num_cache_write_tokens: int = 0  # prompt tokens it wrote into the prefix cache
    num_preemptions: int = 0
    max_computed_tokens: int = 0  # high-water mark of num_computed_tokens (recompute cost)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    ever_started: bool = False
    # False while the request still needs this prompt's logits (prompt logprobs): the
    # scheduler then does not look the prefix cache up for it.
    prefix_lookup: bool = True
    # the disk tier (engine.scheduler._waits_for_disk): when it started waiting for its
    # prefix's reads, and whether it is done with the disk (nothing to read, or waited)
    disk_wait_since: float | None = None
    disk_done: bool = False

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list (a decode step
        reads one token of a sequence that may hold thousands)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """True while the prompt (or, after a recompute preemption, the history) is not
        fully computed."""
        return self.num_tokens_to_compute > 1

    def sort_key(self) -> tuple[int, float]:
        """Admission order: priority, then arrival (FCFS). Preemption picks the max."""
        return (self.priority, self.arrival_time)
