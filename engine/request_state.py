"""RequestState: one request as the engine tracks it, and the RequestOutput it reports.

A request starts as one sequence; with n > 1 its children are added when the first one's
prompt is done (the engine forks them in the cache). Each sequence has its completion
(engine.completion: tokens, text, stop rules) and, when it samples with a temperature,
its own generator, seeded by the request's seed and its index: a request draws the same
tokens whatever it is batched with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvscope.engine.completion import CompletionState
from kvscope.engine.model.tokenizer import Tokenizer
from kvscope.engine.outputs import RequestMetrics, RequestOutput
from kvscope.engine.sampling_ops import make_generator
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.sequence import Sequence


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seed: int  # base seed: params.seed, else drawn from the engine's seeded generator
    seqs: list[Sequence] = field(default_factory=list)  # index order once forked
    generators: dict[str, torch.Generator | None] = field(default_factory=dict)
    completions: dict[str, CompletionState] = field(default_factory=dict)
    # params.prompt_logprobs: one entry per prompt token computed so far (the first is None)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None  # this request failed inside a step (only it)
    error_is_constraint: bool = False  # ... because of its output constraint (its fault)

    @property
    def finished(self) -> bool:
        if self.error is not None:
            return True
        return len(self.seqs) == self.params.n and all(s.status == "finished" for s in self.seqs)

    def add_seq(self, index: int, priority: int, tokenizer: Tokenizer | None,
                eos_token_ids: set[int], max_model_len: int) -> Sequence:
        """The request's sequence ``index`` (0 .. n-1), with its completion and generator."""
        sid = self.request_id if index == 0 else f"{self.request_id}#{index}"
        seq = Sequence(sid, self.request_id, index, list(self.prompt_token_ids), self.params,
                       priority=priority, arrival_time=self.arrival_time)
        budget = min(self.params.max_tokens, max_model_len - len(self.prompt_token_ids))
        state = CompletionState(index, self.params, tokenizer, self.prompt_token_ids,
                                eos_token_ids, budget)
        seq.output_token_ids = state.output.token_ids  # one list, two views
        self.seqs.append(seq)
        self.completions[sid] = state
        self.generators[sid] = (None if self.params.greedy
                                else make_generator(self.seed, index, "cpu"))
        return seq

    def output(self) -> RequestOutput:
        """What the request has produced so far (every output, each a snapshot)."""
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[self.completions[s.seq_id].output.snapshot() for s in self.seqs],
            finished=self.finished, metrics=self._metrics(),
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None
            else None,
            error=self.error, error_is_constraint=self.error_is_constraint,
        )

    def _metrics(self) -> RequestMetrics:
        firsts = [s.first_token_time for s in self.seqs if s.first_token_time is not None]
        done = [s.finished_time for s in self.seqs if s.finished_time is not None]
        return RequestMetrics(
            arrival_time=self.arrival_time,
            first_token_time=min(firsts) if firsts else None,
            finished_time=max(done) if self.finished and done else None,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_generation_tokens=sum(len(s.output_token_ids) for s in self.seqs),
            num_cached_tokens=self.seqs[0].num_cached_tokens,
            num_cache_write_tokens=self.seqs[0].num_cache_write_tokens,
            num_preemptions=sum(s.num_preemptions for s in self.seqs),
        )
