"""Sampler: a step's logits in, each sampling sequence's next token out.

``engine.sampling_ops`` holds the pure functions, ``engine.sampling_params`` the
params; this module runs them over a step's rows. A row is one sequence that samples
this step (``SampleRow``; the children of an n > 1 fork share their parent's logits row
in the step that forks them).

Per step: the rows that ban nothing are drawn in one batch (``_draw_batched``: greedy
rows by one argmax, tempered rows by one ``sample_batch`` with each row's own generator,
the top logprobs of those that asked by one ``top_logprobs_batch``), with their grammar
masks and their logit-bias and penalty scores; each token then goes through its
completion (stops, text). A row the batch did not draw (banned tokens, or the batch
failed) samples alone, so that an exception one request causes (its parameters, its text)
fails that request only: its row comes back as a ``SampleError`` and its other rows are
not sampled. Each row draws from its own generator either way, so batched and alone draw
the same tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvscope.engine.completion import CompletionState
from kvscope.engine.sampling_ops import (
    adjust_logits,
    greedy_batch,
    sample,
    sample_batch,
    top_logprobs,
    top_logprobs_batch,
)
from kvscope.engine.scheduler import SampledToken
from kvscope.engine.sequence import Sequence
from kvscope.engine.structured import ConstraintError

log = logging.getLogger(__name__)


@dataclass
class SampleRow:
    """One sequence that samples this step: its row of the step's logits, its completion
    (stop rules, grammar, penalties) and its generator (None: greedy)."""

    seq: Sequence
    row: int
    completion: CompletionState
    generator: torch.Generator | None


@dataclass
class SampleError:
    """Sampling ``seq``'s row raised ``error``: its request fails, alone."""

    seq: Sequence
    error: Exception


class Sampler:
    def sample(self, rows: list[SampleRow], logits: torch.Tensor
               ) -> list[SampledToken | SampleError]:
        """Per row, in order: the token it drew and fed to its completion (with the finish
        reason when that ended it), or the error its request failed with; no result for
        the rows of a request that failed at an earlier row."""
        drawn = self._draw_batched(rows, logits)
        results: list[SampledToken | SampleError] = []
        failed: set[str] = set()  # request ids
        for r in rows:
            seq, state = r.seq, r.completion
            if seq.request_id in failed:  # a sibling failed earlier in this step
                continue
            try:
                if seq.seq_id in drawn:
                    tok, logprob, top = drawn[seq.seq_id]
                    done = state.add(tok, logprob, top)
                else:
                    row_logits = logits[r.row:r.row + 1]
                    token, logprobs = sample(row_logits, [seq.params], [r.generator],
                                             [state.banned_token_ids()],
                                             [state.allowed_mask(row_logits.shape[-1])],
                                             state.scores(row_logits))
                    top = top_logprobs(row_logits, [seq.params], token)[0]
                    tok = int(token[0])
                    done = state.add(tok, float(logprobs[0]), top)
            except Exception as e:  # noqa: BLE001 - this request's fault, not the engine's
                failed.add(seq.request_id)
                results.append(SampleError(seq, e))
                continue
            results.append(SampledToken(seq, tok, state.output.finish_reason if done else None))
        return results

    def _draw_batched(self, rows: list[SampleRow], logits: torch.Tensor
                      ) -> dict[str, tuple[int, float, dict[int, float] | None]]:
        """(token, logprob, top logprobs) per sequence id for the rows that ban nothing (a
        grammar's mask, which allows rather than bans, goes with the batch):
        greedy ones by one argmax, tempered ones by one ``sample_batch`` (each row's own
        generator, the same draw as row by row), the top logprobs of those that asked by
        one ``top_logprobs_batch``: a few device reads a step, not a few per row. Empty
        when any of it fails: every row then samples alone, so a fault stays with its own
        request (a tempered row whose draw was already taken then draws again: its seed's
        sequence shifts by one, in this fault path only)."""
        greedy: list[SampleRow] = []
        tempered: list[SampleRow] = []
        for r in rows:
            if not r.completion.banned_token_ids():
                (greedy if r.seq.params.greedy else tempered).append(r)
        drawn: dict[str, tuple[int, float, dict[int, float] | None]] = {}
        try:
            for part in (greedy, tempered):
                if not part:
                    continue
                rows_logits = self._rows(logits, [r.row for r in part])
                allowed = self._grammar_masks(part, rows_logits.shape[-1])
                scores = self._scores(part, rows_logits)
                if part is greedy:
                    ids, logprobs = greedy_batch(rows_logits, allowed, scores)
                else:
                    ids, logprobs = sample_batch(rows_logits, [r.seq.params for r in part],
                                                 [r.generator for r in part], allowed, scores)
                drawn |= {r.seq.seq_id: (t, lp, None) for r, t, lp in
                          zip(part, ids, logprobs, strict=True)}
            asked = [r for r in greedy + tempered if r.seq.params.logprobs is not None]
            if asked:
                tops = top_logprobs_batch(self._rows(logits, [r.row for r in asked]),
                                          [r.seq.params.logprobs for r in asked],
                                          [drawn[r.seq.seq_id][0] for r in asked])
                for r, top in zip(asked, tops, strict=True):
                    drawn[r.seq.seq_id] = (*drawn[r.seq.seq_id][:2], top)
        except ConstraintError:  # a request's grammar: row by row fails that one alone
            return {}
        except Exception:  # noqa: BLE001 - row by row isolates the culprit
            log.exception("batched sampling failed; sampling row by row")
            return {}
        return drawn

    @staticmethod
    def _grammar_masks(part: list[SampleRow], vocab: int) -> torch.Tensor | None:
        """Bool [len(part), vocab]: each row's grammar mask (all True for a row without
        one); None when no row follows a grammar."""
        states = [r.completion for r in part]
        if all(st.matcher is None for st in states):
            return None
        everything = torch.ones(vocab, dtype=torch.bool)
        return torch.stack([everything if st.matcher is None else st.allowed_mask(vocab)
                            for st in states])

    @staticmethod
    def _scores(part: list[SampleRow], rows_logits: torch.Tensor) -> torch.Tensor | None:
        """The rows' scores with their logit biases and penalties, for the batch at once (a
        new tensor: the logits stay raw for the logprobs); None when no row has any."""
        states = [r.completion for r in part]
        if not any(st.params.adjusts_logits for st in states):
            return None
        none = torch.empty(0, dtype=torch.long)
        seen, counted = zip(*(st.penalty_state() if st.params.adjusts_logits
                              else (none, (none, none.float())) for st in states), strict=True)
        return adjust_logits(rows_logits.float(), [st.params for st in states],
                             list(seen), list(counted))

    @staticmethod
    def _rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """``logits[rows]``, without the copy when that is every row in order (the usual
        step: 256 x 49k floats are 50 MB)."""
        if rows == list(range(logits.shape[0])):
            return logits
        return logits[torch.tensor(rows, device=logits.device)]
