"""Random weights of a real model's shapes, built from a config alone (vLLM's
``--load-format dummy``): for machines the weights cannot travel to (the GPU device takes
64 MiB, a GGUF is 98 MB and an 8B checkpoint 16 GB) and for benchmarks, where only the
shapes matter.

A dummy model is named ``dummy:<preset>`` (``dummy:smollm2-135m``, ``dummy:llama-3-8b``),
``dummy:<HF directory or config.json>`` (only the config is read), or given as
``LLM(model=..., load_format="dummy", hf_config={...})``. It has no tokenizer: prompts are
token ids (``{"prompt_token_ids": [...]}`` or a list of ints), and a text prompt is a clear
error.

Invariant: the weights are a pure function of (config, seed, device type, dtype): two
engines built with the same seed on the same kind of device hold identical weights, so
engines that differ only in their cache configuration can be compared token for token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvscope.engine.model.config import ModelConfig, config_from_hf
from kvscope.engine.model.errors import ModelLoadError

if TYPE_CHECKING:  # torch is imported where weights are made: configs stay torch-free
    import torch

PREFIX = "dummy:"
LOAD_FORMATS = ("auto", "dummy")
# Standard deviation of the random matrices: HF's `initializer_range` for Llama. Norm
# weights are ones, as a freshly initialised HF model has them. (vLLM's dummy loader draws
# uniform(-1e-3, 1e-3); so small a scale makes every logit nearly tie, and greedy
# comparisons between engines then hinge on rounding rather than on the cache.)
INIT_STD = 0.02

# HF config.json dicts of the shapes kvscope is measured at. smollm2-135m is the embedded
# model's own config (the GGUF's metadata); llama-3-8b is Meta-Llama-3-8B's.
PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-135m": {
        "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
        "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "intermediate_size": 1536, "vocab_size": 49152, "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2,
    },
    "llama-3-8b": {
        "model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 14336, "vocab_size": 128256, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "max_position_embeddings": 8192, "bos_token_id": 128000, "eos_token_id": 128001,
    },
    # Qwen/Qwen3-0.6B's config.json (q/k norms; head_dim 128 is not hidden / heads).
    "qwen3-0.6b": {
        "model_type": "qwen3", "num_hidden_layers": 28, "hidden_size": 1024,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 3072, "vocab_size": 151936, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "max_position_embeddings": 40960, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    # microsoft/Phi-4-mini-instruct's shapes: fused qkv/gate_up, 3/4 of each head rotated.
    # Its LongRoPE factor lists (48 numbers each) are left out: plain RoPE, since dummy
    # weights make only the shapes matter.
    "phi-4-mini": {
        "model_type": "phi3", "num_hidden_layers": 32, "hidden_size": 3072,
        "num_attention_heads": 24, "num_key_value_heads": 8, "intermediate_size": 8192,
        "vocab_size": 200064, "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "sliding_window": 262144,
        "max_position_embeddings": 131072, "bos_token_id": 199999, "eos_token_id": 199999,
    },
    # google/gemma-3-1b-it's config.json: five sliding-window layers (W = 512) per global one.
    "gemma-3-1b": {
        "model_type": "gemma3_text", "num_hidden_layers": 26, "hidden_size": 1152,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "intermediate_size": 6912, "vocab_size": 262144, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "sliding_window": 512, "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "max_position_embeddings": 32768, "bos_token_id": 2, "eos_token_id": [1, 106],
    },
    # gemma-3-1b's KV cache (26 layers, five windowed of W = 512 per global one, one KV head
    # of 256: what capacity at a KV budget depends on) behind a narrow residual stream, MLP
    # and vocabulary (35x fewer weight bytes), so the whole engine runs 4k-token prompts
    # of it on a CPU (`kvscope bench capacity --hybrid`).
    "gemma-3-1b-kv": {
        "model_type": "gemma3_text", "num_hidden_layers": 26, "hidden_size": 256,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
        "intermediate_size": 512, "vocab_size": 4096, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0, "sliding_window": 512, "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "max_position_embeddings": 32768, "bos_token_id": 2, "eos_token_id": [1, 106],
    },
    # A few-MB model of the same family for CPU smoke runs (scripts/gpu_check.py --smoke).
    "tiny": {
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "vocab_size": 512, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
    },
}


def is_dummy(model: str | Any) -> bool:
    return isinstance(model, str) and model.startswith(PREFIX)


def dummy_name(model: str) -> str:
    """``model`` as a ``dummy:`` name (``LLM(model="llama-3-8b", load_format="dummy")``)."""
    return model if is_dummy(model) else PREFIX + model


def dummy_config(model: str, hf_config: dict[str, Any] | None = None) -> ModelConfig:
    """The config of ``dummy:<preset | HF dir | config.json>``; ``hf_config`` (an HF
    config.json dict) replaces the named one entirely when given."""
    spec = model[len(PREFIX):] if is_dummy(model) else model
    if hf_config is not None:
        if not isinstance(hf_config, dict):
            raise ModelLoadError(f"hf_config must be a dict (HF config.json), "
                                 f"got {type(hf_config).__name__}")
        return config_from_hf(hf_config, f"{PREFIX}{spec} (hf_config)")
    if spec in PRESETS:
        return config_from_hf(PRESETS[spec], PREFIX + spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{path}: not readable JSON ({exc})") from exc
        return config_from_hf(cfg, str(path))
    raise ModelLoadError(f"{PREFIX}{spec}: unknown dummy model; use one of "
                         f"{', '.join(PREFIX + p for p in PRESETS)}, or dummy:<HF directory or "
                         "config.json>")


def dummy_tensors(config: ModelConfig, device: torch.device | str, dtype: torch.dtype,
                  seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, random tensor) for every tensor ``config`` needs, drawn on ``device`` in
    ``dtype`` from one generator seeded with ``seed``, in a fixed order."""
    import torch

    from kvscope.engine.model.llama import expected_shapes

    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    for name, shape in expected_shapes(config).items():
        if name.endswith("norm.weight"):  # Gemma stores w of its (1 + w) norms: zeros
            fill = torch.zeros if config.architecture == "gemma3_text" else torch.ones
            yield name, fill(shape, device=device, dtype=dtype)
        elif name.endswith(".bias"):
            yield name, torch.zeros(shape, device=device, dtype=dtype)
        else:
            t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
            yield name, t.mul_(INIT_STD).to(dtype)


def load_dummy(model: str, device: torch.device | str, dtype: torch.dtype, seed: int = 0,
               hf_config: dict[str, Any] | None = None):
    """(LlamaModel with random weights, None, ModelConfig): no file is read but an optional
    config.json."""
    from kvscope.engine.model.architectures import model_class

    config = dummy_config(model, hf_config)
    return (model_class(config).from_tensors(config, dummy_tensors(config, device, dtype, seed),
                                             dummy_name(model), device), None, config)


def weight_bytes(config: ModelConfig, dtype_bytes: int) -> int:
    """Bytes of weights one decode step reads (the decode floor's weight term): every
    matrix once, the lm_head included; of the embedding only a few rows (not counted)."""
    from kvscope.engine.model.llama import expected_shapes

    total = config.vocab_size * config.hidden_size  # the lm_head (tied or not)
    for name, shape in expected_shapes(config).items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            continue
        n = 1
        for s in shape:
            n *= s
        total += n
    return total * dtype_bytes
