"""CompletionState: one completion's tokens, text and stop rules, in one place.

Both the plain reference generation and the paged engine feed sampled tokens through
``CompletionState.add``, so the two cannot disagree on when a completion ends or what its
text is. Stops, first that applies: EOS (unless ignore_eos), a stop token id, a stop
string found in the incrementally detokenized text (trimmed from the text unless
``include_stop_str_in_output``), then ``budget`` tokens reached ("length"). Before
``params.min_tokens`` tokens no stop rule applies (vLLM's min_tokens), and
``banned_token_ids`` tells the sampler to keep EOS and the stop token ids out. With
``params.structured_outputs`` a grammar matcher follows the tokens: ``allowed_mask`` is the
next token's constraint, and the completion stops ("stop") once the grammar is complete,
whatever min_tokens says (only EOS could follow). With a logit bias or penalties
(``params.adjusts_logits``) ``scores`` gives the next token's: which tokens the prompt and
output hold, and how often the output does, are kept from the first call on
(``penalty_state``).
"""

from __future__ import annotations

from typing import Any

import torch

from kvscope.engine.model.detokenizer import IncrementalDetokenizer
from kvscope.engine.model.tokenizer import Tokenizer
from kvscope.engine.outputs import CompletionOutput
from kvscope.engine.sampling_ops import adjust_logits
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.structured import GrammarMatcher


def find_stop_string(text: str, new_len: int, stops: list[str]) -> tuple[str, int] | None:
    """The first stop string that ends inside the last `new_len` characters of text, and the
    index where it starts. Only the new tail (plus overlap) is searched: O(new) per step."""
    best: tuple[str, int] | None = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        pos = text.find(stop, start)
        if pos != -1 and (best is None or pos < best[1]):
            best = (stop, pos)
    return best


class CompletionState:
    """Invariant: ``output.finish_reason`` is None until the completion has ended, and no
    token is added after that."""

    def __init__(self, index: int, params: SamplingParams, tokenizer: Tokenizer | None,
                 prompt_token_ids: list[int], eos_token_ids: set[int], budget: int) -> None:
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.params = params
        self.budget = budget  # max new tokens: min(max_tokens, max_model_len - prompt)
        self.eos_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.stop_ids = set(params.stop_token_ids)
        self.detok = (IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                             params.skip_special_tokens)
                      if tokenizer is not None else None)
        self.matcher = (GrammarMatcher(params.structured_outputs, tokenizer)
                        if params.structured_outputs is not None else None)
        self.prompt_token_ids = prompt_token_ids
        self._seen: set[int] | None = None  # penalties: ids in the prompt or the output
        self._counts: dict[int, int] = {}  # penalties: output id -> count
        self._tensors: Any = None  # penalty_state's, until the next token
        self.text = ""
        self.output = CompletionOutput(index=index, text="", token_ids=[],
                                       cumulative_logprob=0.0,
                                       logprobs=[] if params.logprobs is not None else None)

    @property
    def finished(self) -> bool:
        return self.output.finish_reason is not None

    def banned_token_ids(self) -> set[int]:
        """Token ids the next sample may not take: EOS and stop ids before min_tokens."""
        if len(self.output.token_ids) >= self.params.min_tokens:
            return set()
        return self.eos_ids | self.stop_ids

    def allowed_mask(self, vocab_size: int) -> torch.Tensor | None:
        """Bool [vocab_size] of the tokens the next sample may take; None: unconstrained."""
        return self.matcher.allowed(vocab_size) if self.matcher is not None else None

    def penalty_state(self) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """What ``sampling.adjust_logits`` needs of this completion for its next token:
        the distinct token ids of the prompt and the output, and the output's distinct ids
        with their counts (CPU tensors, a few hundred entries, rebuilt when they change)."""
        if self._seen is None:
            self._seen = set(self.prompt_token_ids) | set(self.output.token_ids)
            self._counts = {}
            for t in self.output.token_ids:
                self._counts[t] = self._counts.get(t, 0) + 1
            self._tensors = None
        if self._tensors is None:
            self._tensors = (torch.tensor(sorted(self._seen), dtype=torch.long),
                             (torch.tensor(list(self._counts), dtype=torch.long),
                              torch.tensor(list(self._counts.values()), dtype=torch.float32)))
        return self._tensors

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token's scores: ``logits`` ([1, V]) with the request's logit bias and
        penalties; ``logits`` itself when it has none."""
        if not self.params.adjusts_logits:
            return logits
        seen, counted = self.penalty_state()
        return adjust_logits(logits.float(), [self.params], [seen], [counted])

    def add(self, token: int, logprob: float, top: dict[int, float] | None = None) -> bool:
        """Record a sampled token; returns True when it ended the completion."""
        out = self.output
        if self.matcher is not None:
            self.matcher.accept(token)  # first: a token it refuses records nothing
        out.token_ids.append(token)
        if self._seen is not None:
            self._seen.add(token)
            self._counts[token] = self._counts.get(token, 0) + 1
            self._tensors = None
        out.cumulative_logprob += logprob
        if out.logprobs is not None:
            out.logprobs.append(top)
        if len(out.token_ids) < min(self.params.min_tokens, self.budget):  # no stop yet (vLLM)
            if self.detok is not None:
                self.text += self.detok.add(token)
        elif token in self.eos_ids:
            out.finish_reason = "stop"
        elif token in self.stop_ids:
            # As vLLM: a stop token's text stays in the output unless it is a special token.
            self.text += self.detok.add(token) if self.detok is not None else ""
            out.finish_reason, out.stop_reason = "stop", token
        else:
            if self.detok is not None:
                delta = self.detok.add(token)
                self.text += delta
                hit = find_stop_string(self.text, len(delta), self.params.stop) if delta else None
                if hit is not None:
                    stop, pos = hit
                    keep = pos + len(stop) if self.params.include_stop_str_in_output else pos
                    self.text = self.text[:keep]
                    out.finish_reason, out.stop_reason = "stop", stop
            if out.finish_reason is None and len(out.token_ids) >= self.budget:
                out.finish_reason = "length"
        if out.finish_reason is None and self.matcher is not None and self.matcher.stopped:
            out.finish_reason = "stop"  # the grammar is complete: only EOS could follow
        out.text = self.text
        return out.finish_reason is not None
