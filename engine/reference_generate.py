"""Plain single-sequence generation over a contiguous KV cache: the correctness reference
the paged engine is compared against. No batching, no scheduling, nothing clever."""

from __future__ import annotations

import torch

from engine.model.contiguous_cache import ContiguousKVCache
from engine.model.detokenizer import IncrementalDetokenizer
from engine.model.llama import LlamaModel
from engine.model.tokenizer import Tokenizer
from engine.outputs import CompletionOutput
from engine.sampling import SamplingParams, make_generator, sample, top_logprobs


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


def generate_reference(model: LlamaModel, tokenizer: Tokenizer | None,
                       prompt_token_ids: list[int], params: SamplingParams, *,
                       index: int = 0, seed: int | None = None,
                       max_model_len: int | None = None) -> CompletionOutput:
    """Generate one completion. Randomness comes from a generator seeded with params.seed
    (else `seed`, else 0), derived per completion `index`.

    Stops on (first that applies): EOS (unless ignore_eos), a stop token id, a stop string
    (found in the incrementally detokenized text, trimmed from it unless
    include_stop_str_in_output), max_tokens or max_model_len ("length")."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty: at least one token is needed")
    config = model.config
    max_len = max_model_len or config.max_position_embeddings
    if len(prompt_token_ids) >= max_len:
        raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens; max_model_len is "
                         f"{max_len}, leaving no room to generate")
    if any(t < 0 or t >= config.vocab_size for t in prompt_token_ids):
        raise ValueError(f"prompt token ids must lie in [0, {config.vocab_size})")
    if params.stop and tokenizer is None:
        raise ValueError("stop strings need a tokenizer")

    budget = min(params.max_tokens, max_len - len(prompt_token_ids))
    cache = ContiguousKVCache(config, len(prompt_token_ids) + budget, model.device, model.dtype)
    generator = None
    if not params.greedy:
        base = params.seed if params.seed is not None else (seed or 0)
        generator = make_generator(base, index, model.device)
    detok = (IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
             if tokenizer is not None else None)
    eos_ids = set() if params.ignore_eos else set(config.eos_token_ids)
    if tokenizer is not None and not params.ignore_eos:
        eos_ids |= set(tokenizer.eos_token_ids)
    stop_ids = set(params.stop_token_ids)

    out = CompletionOutput(index=index, text="", token_ids=[], cumulative_logprob=0.0,
                           logprobs=[] if params.logprobs is not None else None)
    text = ""
    feed = torch.tensor(prompt_token_ids, device=model.device)
    position = 0
    while True:
        positions = torch.arange(position, position + feed.shape[0], device=model.device)
        hidden = model.forward(feed, positions, cache)
        position += feed.shape[0]
        logits = model.compute_logits(hidden[-1:])
        token_ids, logprobs = sample(logits, [params], [generator])
        token = int(token_ids[0])
        out.token_ids.append(token)
        out.cumulative_logprob += float(logprobs[0])
        if out.logprobs is not None:
            out.logprobs.append(top_logprobs(logits, [params], token_ids)[0])
        if token in eos_ids:
            out.finish_reason = "stop"
            break
        if token in stop_ids:
            # As vLLM: a stop token's text stays in the output unless it is a special token.
            text += detok.add(token) if detok is not None else ""
            out.finish_reason, out.stop_reason = "stop", token
            break
        if detok is not None:
            delta = detok.add(token)
            text += delta
            hit = find_stop_string(text, len(delta), params.stop) if delta else None
            if hit is not None:
                stop, pos = hit
                text = text[:pos + len(stop)] if params.include_stop_str_in_output else text[:pos]
                out.finish_reason, out.stop_reason = "stop", stop
                break
        if len(out.token_ids) >= budget:
            out.finish_reason = "length"
            break
        feed = torch.tensor([token], device=model.device)
    out.text = text
    return out
