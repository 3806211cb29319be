"""Plain single-sequence generation over a contiguous KV cache: the correctness reference
the paged engine is compared against. No batching, no scheduling, nothing clever."""

from __future__ import annotations

import torch

from kvscope.engine.completion import CompletionState
from kvscope.engine.model.contiguous_cache import ContiguousKVCache
from kvscope.engine.model.llama import LlamaModel
from kvscope.engine.model.tokenizer import Tokenizer
from kvscope.engine.outputs import CompletionOutput
from kvscope.engine.sampling_ops import make_generator, sample, top_logprobs
from kvscope.engine.sampling_params import SamplingParams


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

    budget = min(params.max_tokens, max_len - len(prompt_token_ids))
    cache = ContiguousKVCache(config, len(prompt_token_ids) + budget, model.device, model.dtype)
    generator = None
    if not params.greedy:
        base = params.seed if params.seed is not None else (seed or 0)
        generator = make_generator(base, index, "cpu")  # as the engine's (engine.sampling_ops)
    eos_ids = set(config.eos_token_ids) | (set(tokenizer.eos_token_ids) if tokenizer else set())
    state = CompletionState(index, params, tokenizer, prompt_token_ids, eos_ids, budget)
    feed = torch.tensor(prompt_token_ids, device=model.device)
    position = 0
    while True:
        positions = torch.arange(position, position + feed.shape[0], device=model.device)
        hidden = model.forward(feed, positions, cache)
        position += feed.shape[0]
        logits = model.compute_logits(hidden[-1:])
        token_ids, logprobs = sample(logits, [params], [generator], [state.banned_token_ids()],
                                     [state.allowed_mask(logits.shape[-1])],
                                     state.scores(logits))
        top = top_logprobs(logits, [params], token_ids)[0]
        if state.add(int(token_ids[0]), float(logprobs[0]), top):
            return state.output
        feed = token_ids.to(model.device)
