"""OpenAI response shapes built from the engine's RequestOutputs (pure functions).

A completions request may carry a batch of prompts; its choices are numbered
``prompt_index * n + completion_index`` (OpenAI's order). Chat requests have one prompt.
"""

from __future__ import annotations

import copy
from typing import Any

from kvscope.engine.outputs import CompletionOutput, RequestOutput


def usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.metrics.num_cached_tokens for o in outputs if o.metrics is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class TokenText:
    """Token id -> its text, for logprobs (special tokens shown, as OpenAI does). Without a
    tokenizer (a dummy model) a token is named ``token_id:N``, as vLLM's
    ``--return-tokens-as-token-ids`` names it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


def _top(entry: dict[int, float], chosen: int, k: int) -> list[tuple[int, float]]:
    others = sorted(entry.items(), key=lambda kv: -kv[1])
    return others[:k] if k else [(chosen, entry[chosen])]


def completion_logprobs(c: CompletionOutput, start: int, end: int, k: int,
                        text_of: TokenText, text_offset0: int = 0) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for tokens [start, end)."""
    tokens, lps, tops, offsets = [], [], [], []
    offset = text_offset0
    for j in range(start, min(end, len(c.logprobs or []))):
        tid = c.token_ids[j]
        entry = c.logprobs[j] or {tid: float("nan")}
        s = text_of(tid)
        tokens.append(s)
        lps.append(entry.get(tid))
        tops.append({text_of(t): lp for t, lp in _top(entry, tid, k)})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


def prompt_completion_logprobs(out: RequestOutput, k: int,
                               text_of: TokenText) -> dict[str, Any]:
    """The legacy ``logprobs`` object of the prompt tokens (echo): the first token has
    no logprob (None, as OpenAI), each other its teacher-forced logprob and top k."""
    tokens, lps, tops, offsets = [], [], [], []
    offset = 0
    entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    for tid, entry in zip(out.prompt_token_ids, entries, strict=True):
        s = text_of(tid)
        tokens.append(s)
        lps.append(entry.get(tid) if entry else None)
        tops.append({text_of(t): lp for t, lp in _top(entry, tid, k)} if entry else None)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


def join_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(out: RequestOutput, k: int,
                         text_of: TokenText) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` of a completions choice: per prompt token None (the
    first) or {token_id: {"logprob", "rank", "decoded_token"}} for it and the top k
    (rank: 1-based place among the top k, None when it is not among them)."""
    result: list[dict[str, dict[str, Any]] | None] = []
    entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    for tid, entry in zip(out.prompt_token_ids, entries, strict=True):
        if entry is None:
            result.append(None)
            continue
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:k]
        ranks = {t: r for r, (t, _) in enumerate(ranked, 1)}
        keep = dict(ranked) | {tid: entry[tid]}
        result.append({str(t): {"logprob": lp, "rank": ranks.get(t),
                                "decoded_token": text_of(t)} for t, lp in keep.items()})
    return result


def without_generation(out: RequestOutput) -> RequestOutput:
    """The output of a prompt-only request (echo, max_tokens 0): no generated token."""
    out = copy.copy(out)
    out.outputs = [CompletionOutput(index=c.index, text="", token_ids=[],
                                    cumulative_logprob=0.0,
                                    logprobs=[] if c.logprobs is not None else None,
                                    finish_reason="length") for c in out.outputs]
    return out


def chat_logprobs(c: CompletionOutput, start: int, end: int, k: int,
                  text_of: TokenText) -> dict[str, Any]:
    """The chat ``logprobs`` object ({"content": [...]}) for tokens [start, end)."""
    content = []
    for j in range(start, min(end, len(c.logprobs or []))):
        tid = c.token_ids[j]
        entry = c.logprobs[j] or {tid: float("nan")}
        s = text_of(tid)
        content.append({
            "token": s, "logprob": entry.get(tid), "bytes": list(s.encode()),
            "top_logprobs": [{"token": text_of(t), "logprob": lp,
                              "bytes": list(text_of(t).encode())}
                             for t, lp in (_top(entry, tid, k) if k else [])],
        })
    return {"content": content}


def finish_reason(c: CompletionOutput) -> str | None:
    return c.finish_reason


class DeltaTracker:
    """What of each choice's cumulative text has been streamed.

    With stop strings, the engine trims a matched stop string from the text, which may
    take back characters of a partial match streamed earlier; so while a choice runs,
    the last ``max(len(stop)) - 1`` characters are held back (they are sent at the end).
    """

    def __init__(self, stops: list[str]) -> None:
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent_chars: dict[int, int] = {}
        self.sent_tokens: dict[int, int] = {}
        self.finished: set[int] = set()

    def delta(self, choice: int, c: CompletionOutput) -> tuple[str, int, int, bool] | None:
        """(new text, first new token, end token, just finished) or None if nothing new."""
        if choice in self.finished:
            return None
        done = c.finish_reason is not None
        sent = self.sent_chars.get(choice, 0)
        upto = len(c.text) if done else max(sent, len(c.text) - self.hold)
        text = c.text[sent:upto]
        if not text and not done:
            return None  # tokens whose text is held back go out with the next delta
        t0, t1 = self.sent_tokens.get(choice, 0), len(c.token_ids)
        self.sent_chars[choice] = max(sent, upto)
        self.sent_tokens[choice] = t1
        if done:
            self.finished.add(choice)
        return text, t0, t1, done
