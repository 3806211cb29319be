"""The `LLM` facade (vLLM's offline API): load a model once, generate for many prompts.

Kept thin on purpose: today each completion runs through generate_reference (contiguous cache,
one sequence at a time); the paged engine replaces `_run` without changing this surface.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
import torch

from engine.model.errors import ModelLoadError
from engine.model.loader import load_model
from engine.model.tokenizer import Tokenizer
from engine.outputs import RequestMetrics, RequestOutput
from engine.reference_generate import generate_reference
from engine.sampling import SamplingParams

Prompt = str | dict[str, Any]
Conversation = list[dict[str, Any]]

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """"auto": float32 on CPU (bf16 matmuls there are slow and less exact), bfloat16 on CUDA."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


class LLM:
    """LLM(model="smollm2" | path to .gguf | HF directory, device="auto", dtype="auto",
    seed=0, max_model_len=None). Requests without their own seed draw one from a generator
    seeded with `seed`, so a whole run is reproducible."""

    def __init__(self, model: str = "smollm2", device: str | torch.device = "auto",
                 dtype: str | torch.dtype = "auto", seed: int = 0,
                 max_model_len: int | None = None, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(f"LLM() got unknown argument(s) {', '.join(sorted(kwargs))}; "
                            "accepted: model, device, dtype, seed, max_model_len")
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model, tokenizer, self.config = load_model(model, self.device, self.dtype)
        if tokenizer is None:
            raise ModelLoadError(f"{model}: no tokenizer (tokenizer.json) found beside the model")
        self.tokenizer: Tokenizer = tokenizer
        limit = self.config.max_position_embeddings
        if max_model_len is not None and not 1 < max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [2, {limit}], got {max_model_len}")
        self.max_model_len = max_model_len or limit
        self._seeds = np.random.default_rng(seed)
        self._request_counter = itertools.count()

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt is a string (tokenized as is, no
        chat template) or {"prompt_token_ids": [...]}."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        params_list = self._params_per_prompt(sampling_params, len(prompts))
        requests = [self._tokenize(p) for p in prompts]  # validate all before running any
        from tqdm import tqdm

        outputs = []
        for (text, ids), params in tqdm(list(zip(requests, params_list, strict=True)),
                                         desc="generate", disable=not use_tqdm):
            outputs.append(self._run(text, ids, params))
        return outputs

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the chat template to one conversation (a list of {"role", "content"} dicts) or
        to each of a list of conversations, then generate."""
        if not messages:
            raise ValueError("chat() needs at least one message")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(list(conversation), add_generation_prompt)
            # The rendered template already holds BOS/special tokens: add none (as HF does).
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm)

    # -- internals ------------------------------------------------------------------------
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

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            # Chat-templated text already holds its special tokens; a raw prompt gets BOS only
            # if the model asks for it (Tokenizer.encode knows).
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = [int(t) for t in prompt["prompt_token_ids"]]
            return prompt.get("prompt"), ids
        raise TypeError(f"a prompt is a str or {{'prompt_token_ids': [...]}}, got {prompt!r}")

    def _run(self, text: str | None, ids: list[int], params: SamplingParams) -> RequestOutput:
        metrics = RequestMetrics(arrival_time=time.monotonic(), num_prompt_tokens=len(ids))
        seed = int(self._seeds.integers(2**62))
        completions = [
            generate_reference(self.model, self.tokenizer, ids, params, index=i, seed=seed,
                               max_model_len=self.max_model_len)
            for i in range(params.n)
        ]
        metrics.finished_time = time.monotonic()
        metrics.num_generation_tokens = sum(len(c.token_ids) for c in completions)
        return RequestOutput(request_id=str(next(self._request_counter)), prompt=text,
                             prompt_token_ids=ids, outputs=completions, finished=True,
                             metrics=metrics)
