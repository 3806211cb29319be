"""The `LLM` facade (vLLM's offline API): load a model once, generate for many prompts.

Kept thin on purpose: requests go to an LLMEngine (paged KV cache, continuous batching),
reachable as ``llm.llm_engine`` as in vLLM.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvscope.engine.config import EngineConfig
from kvscope.engine.device import resolve_device, resolve_dtype
from kvscope.engine.engine import LLMEngine
from kvscope.engine.model.tokenizer import Tokenizer
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | dict[str, Any]
Conversation = list[dict[str, Any]]

class LLM:
    """LLM(model="smollm2" | path to .gguf | HF directory, device="auto", dtype="auto",
    seed=0, max_model_len=None, **engine_args). Engine arguments take vLLM's names
    (block_size, num_gpu_blocks, enable_prefix_caching, kv_cache_dtype, swap_space,
    max_num_seqs, max_num_batched_tokens, events_endpoint, record_path, ...; see
    engine.config.EngineConfig). Requests without their own seed draw one from a generator
    seeded with `seed`, so a whole run is reproducible.

    ``load_format="dummy"`` (vLLM's name) builds random weights of the model's shapes, drawn
    from `seed`, with no file: `model` names a preset ("smollm2-135m", "llama-3-8b") or
    ``hf_config`` (an HF config.json dict) gives the shapes; ``model="dummy:llama-3-8b"``
    is the same. Such a model has no tokenizer: prompts are {"prompt_token_ids": [...]}."""

    def __init__(self, model: str = "smollm2", device: str | torch.device = "auto",
                 dtype: str | torch.dtype = "auto", seed: int = 0,
                 max_model_len: int | None = None, **kwargs: Any) -> None:
        try:
            config = EngineConfig.from_kwargs(model=str(model), device=str(device),
                                              dtype=dtype, seed=seed,
                                              max_model_len=max_model_len, **kwargs)
        except TypeError as e:
            raise TypeError(f"LLM(): {e}") from None
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        config.dtype = self.dtype
        self.llm_engine = LLMEngine(config)
        eng = self.llm_engine
        # No tokenizer (a dummy model, an HF dir without tokenizer.json): prompts are token
        # ids, and text is refused with a clear error (as vLLM's skip_tokenizer_init).
        self.model, self.tokenizer, self.config = eng.model, eng.tokenizer, eng.model_config
        self.max_model_len = eng.max_model_len
        self._next_id = 0

    def get_tokenizer(self) -> Tokenizer | None:
        return self.tokenizer

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is a string (tokenized as is, no
        chat template) or {"prompt_token_ids": [...]}. Every prompt is validated before any
        runs: one bad prompt raises and leaves the engine as it was."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        eng = self.llm_engine
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                if not isinstance(prompt, str | dict):
                    raise TypeError(f"a prompt is a str or {{'prompt_token_ids': [...]}}, "
                                    f"got {prompt!r}")
                rid = str(self._next_id)
                # only each request's last output is kept: the engine need not build the
                # others (a copy of every running request's tokens, every step)
                eng.add_request(rid, prompt, dataclasses.replace(
                    params, output_kind=RequestOutputKind.FINAL_ONLY))
                self._next_id += 1
                ids.append(rid)
        except BaseException:
            for rid in ids:
                eng.abort_request(rid)
            raise
        from tqdm import tqdm

        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while len(done) < len(ids):
                for out in eng.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[rid] for rid in ids]

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the chat template to one conversation (a list of {"role", "content"} dicts) or
        to each of a list of conversations, then generate."""
        if not messages:
            raise ValueError("chat() needs at least one message")
        if self.tokenizer is None:
            raise ValueError(f"chat() needs a tokenizer; {self.llm_engine.config.model} has "
                             "none: use generate() with {'prompt_token_ids': [...]}")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(list(conversation), add_generation_prompt)
            # The rendered template already holds BOS/special tokens: add none (as HF does).
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    @staticmethod
    def _params_per_prompt(sampling_params: SamplingParams | list[SamplingParams] | None,
                           count: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        if len(sampling_params) != count:
            raise ValueError(f"{len(sampling_params)} sampling params for {count} prompts")
        return list(sampling_params)
