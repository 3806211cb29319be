"""StandInModel: a model that costs time, not compute, for cluster benchmarks on a small
machine (``kvscope bench route --stand-in``). Named like a model: ``stand-in:MODEL`` (for
example ``kvscope serve --model stand-in:smollm2``) loads MODEL's config and tokenizer and
no weights.

Four real replicas of even the 135M model do not fit on a 2-core box at once: each
would get half a core and the numbers would measure contention. A stand-in replica runs
everything real (tokenizer, chat template, scheduler, KV cache manager with prefix
caching, events, HTTP server) except the forward pass: each step *sleeps* for what the
real model's step costs on one core of this box, linear in the work the step does,

    step_s = base_s + prefill_s_per_token * prefill tokens + decode_s_per_seq * decode rows

and returns logits whose argmax is a deterministic ordinary word (so answers are text and
conversations grow as with a real model). Because the cost is in the prefill tokens
actually computed, a prefix-cache hit saves exactly the time it saves in the real
engine; the sleep leaves the CPU to the other replicas, as separate machines would.
Results measured with it say so (the bench prints "stand-in").
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

# SmolLM2-135M fp32 on one core of the dev box (2-core Xeon), from engine steps measured
# on 2026-11-23 under load average ~5 (prefill 8.2 ms/token; decode 127 ms for 1 sequence,
# 246 ms for 4) scaled by 1/2.5 to an unshared core (the quiet-box figures in
# docs/BENCHMARKS.md run ~2.5x faster than loaded ones). Every policy sees the same costs.
BASE_S = 0.035
PREFILL_S_PER_TOKEN = 0.0033
DECODE_S_PER_SEQ = 0.016
WORDS = (" the cache keeps recent blocks of tokens so that a later request with the same "
         "beginning can skip work and answer sooner")


@dataclass
class StepCost:
    base_s: float = BASE_S
    prefill_s_per_token: float = PREFILL_S_PER_TOKEN
    decode_s_per_seq: float = DECODE_S_PER_SEQ


class StandInModel:
    """The two calls the runner makes: ``forward(ids, positions, attn) -> hidden`` and
    ``compute_logits(hidden) -> logits``. Invariant: the greedy token after (token t at
    position p) is ``words[(t + p) % len(words)]``, never an end-of-sequence token."""

    def __init__(self, vocab_size: int, word_ids: list[int], cost: StepCost | None = None
                 ) -> None:
        self.vocab_size = vocab_size
        self.word_ids = torch.tensor(word_ids, dtype=torch.int64)
        self.cost = cost or StepCost()
        self.slept_s = 0.0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:  # noqa: ANN001
        batch = getattr(attn, "batch", None)
        if batch is not None:
            q_lens = (batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1]).tolist()
            decode = sum(1 for n in q_lens if n == 1)
        else:
            decode = 0
        prefill = int(input_ids.numel()) - decode
        c = self.cost
        delay = c.base_s + c.prefill_s_per_token * prefill + c.decode_s_per_seq * decode
        self.slept_s += delay
        time.sleep(delay)
        return torch.stack([input_ids, positions], dim=1)  # the "hidden state": (t, p)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        pick = self.word_ids[(hidden[:, 0] + hidden[:, 1]) % len(self.word_ids)]
        logits = torch.zeros(hidden.shape[0], self.vocab_size)
        logits[torch.arange(hidden.shape[0]), pick] = 10.0
        return logits


PREFIX = "stand-in:"


def is_stand_in(model: object) -> bool:
    return isinstance(model, str) and model.startswith(PREFIX)


def stand_in_target(model: str) -> str:
    """The real model whose config and tokenizer a ``stand-in:`` name borrows."""
    return model[len(PREFIX):] or "smollm2"


def stand_in_for(config: Any, tokenizer: Any) -> StandInModel:
    """A StandInModel for ``config``'s vocabulary, answering with ``tokenizer``'s words
    (token ids 7, 8, 9 without one)."""
    words = tokenizer.encode(WORDS, add_special_tokens=False) if tokenizer else [7, 8, 9]
    eos = set(config.eos_token_ids) | set(tokenizer.eos_token_ids if tokenizer else ())
    words = [w for w in words if w not in eos and w < config.vocab_size] or [0]
    return StandInModel(config.vocab_size, words)
