"""Read a GGUF file: its config, its tensors (dequantized, renamed to the HF layout) and its
tokenizer metadata. Every failure becomes a ModelLoadError naming the file (and tensor)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvscope.engine.model.config import ModelConfig, longrope_parameters
from kvscope.engine.model.errors import ModelLoadError

# GGUF architecture -> our ModelConfig.architecture. llama.cpp permutes Q/K rows only for
# the ones it converts through its LlamaModel (llama, mistral); the others keep HF's order.
_GGUF_ARCHS = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
               "gemma3": "gemma3_text", "phi3": "phi3"}
_PERMUTED_QK = {"llama", "mistral"}
# llama.cpp's converter of Gemma 3 (text) windows every layer but each 6th, when its GGUF
# names no pattern (llama.cpp's loader assumes the same), and writes no local RoPE base in
# older files (its loader then uses 10000).
_GEMMA3_PATTERN = 6
_GEMMA3_LOCAL_BASE = 10000.0

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3's four norms a layer: llama.cpp names the one before the MLP ffn_norm (in Llama the
# norm HF calls post_attention_layernorm) and the one after attention post_attention_norm.
_GEMMA3_LAYER_NAMES = _LAYER_NAMES | {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3 keeps HF's fused q/k/v and gate/up (gate rows first) under llama.cpp's names.
_PHI3_LAYER_NAMES = {k: v for k, v in _LAYER_NAMES.items()
                     if not k.startswith(("attn_q.", "attn_k.", "attn_v.", "ffn_gate."))} | {
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}
_ARCH_LAYER_NAMES = {"gemma3": _GEMMA3_LAYER_NAMES, "phi3": _PHI3_LAYER_NAMES}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def open_gguf(path: Path) -> Any:
    """Open a GGUF file; a missing, corrupt or truncated file raises ModelLoadError."""
    import gguf

    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors...
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") \
            from exc


def _field(reader: Any, key: str, path: Path, default: Any = ...) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if default is ...:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {key!r}")
        return default
    try:
        return field.contents()
    except Exception as exc:
        raise ModelLoadError(f"{path}: GGUF metadata {key!r} is unreadable: {exc}") from exc


def gguf_architecture(reader: Any, path: Path) -> str:
    arch = _field(reader, "general.architecture", path)
    if arch not in _GGUF_ARCHS:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r} (supported: {', '.join(_GGUF_ARCHS)})"
        )
    return arch


def gguf_config(reader: Any, path: Path) -> ModelConfig:
    arch = gguf_architecture(reader, path)

    def get(key: str, default: Any = ...) -> Any:
        return _field(reader, f"{arch}.{key}", path, default)

    hidden = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    rope_dims = int(get("rope.dimension_count", 0))
    # Phi-3 writes no key_length, and its rope.dimension_count is the rotated part only.
    head_dim = int(get("attention.key_length", 0) or (0 if arch == "phi3" else rope_dims)
                   or hidden // num_heads)
    embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    vocab = get("vocab_size", None)
    if embed is not None and len(embed.shape) == 2:
        # the embedding's rows are the model's vocabulary (llama.cpp trims Gemma 3's unused
        # padding rows, so its metadata may name more)
        vocab = int(embed.shape[1])
    elif vocab is None:
        vocab = len(_field(reader, "tokenizer.ggml.tokens", path))
    rope_scaling = None
    scaling_type = get("rope.scaling.type", None)
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"{path}: unsupported rope scaling {scaling_type!r}")
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        # Llama 3.1 GGUFs carry their frequency factors as a tensor; not implemented here.
        raise ModelLoadError(f"{path}: tensor 'rope_freqs.weight' (rope frequency factors) "
                             "is not supported")
    tensor_names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id", path, None)
    eot = _field(reader, "tokenizer.ggml.eot_token_id", path, None)
    eos_ids = tuple(dict.fromkeys(int(t) for t in (eos, eot) if t is not None))
    bos = _field(reader, "tokenizer.ggml.bos_token_id", path, None)
    window = get("attention.sliding_window", None)  # llama.cpp writes it where it applies
    window = window or None  # 0: none (llama.cpp's Phi-3 converter writes 0 for Phi-4)
    if arch == "phi3":
        rope_scaling = _phi3_longrope(reader, path, get, rope_dims or head_dim)
    gemma = _gemma3(get, path, hidden, num_heads, head_dim, window) if arch == "gemma3" else {}
    return ModelConfig(
        architecture=_GGUF_ARCHS[arch],
        num_layers=int(get("block_count")),
        hidden_size=hidden,
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        intermediate_size=int(get("feed_forward_length")),
        vocab_size=int(vocab),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings="output.weight" not in tensor_names,
        max_position_embeddings=int(get("context_length", 2048)),
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        sliding_window=None if window is None else int(window),
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        rotary_dim=rope_dims if arch == "phi3" and 0 < rope_dims < head_dim else None,
        **gemma,
    )


def _phi3_longrope(reader: Any, path: Path, get: Any, rope_dims: int
                   ) -> dict[str, Any] | None:
    """Phi-3's LongRoPE as llama.cpp's converter writes it: the factors as the tensors
    rope_factors_long/short (present only for a LongRoPE model), the pretraining length in
    rope.scaling.original_context_length and the cos/sin scale in rope.scaling.attn_factor;
    the factor is the context length over the pretraining length, as transformers derives
    it."""
    import gguf

    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if not factors:
        return None
    scaling: dict[str, Any] = {"rope_type": "longrope"}
    for kind in ("long", "short"):
        t = factors.get(f"rope_factors_{kind}.weight")
        if t is None:
            raise ModelLoadError(f"{path}: LongRoPE needs tensor 'rope_factors_{kind}.weight'")
        values = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64)
        if values.size != rope_dims // 2:
            raise ModelLoadError(f"{path}: tensor 'rope_factors_{kind}.weight' holds "
                                 f"{values.size} factors, expected {rope_dims // 2}")
        scaling[f"{kind}_factor"] = values.reshape(-1).tolist()
    scaling["original_max_position_embeddings"] = int(
        get("rope.scaling.original_context_length"))
    attention_factor = get("rope.scaling.attn_factor", None)
    if attention_factor is not None:
        scaling["attention_factor"] = float(attention_factor)
    return longrope_parameters(scaling, {"max_position_embeddings": int(get("context_length"))})


def _gemma3(get: Any, path: Path, hidden: int, num_heads: int, head_dim: int,
            window: Any) -> dict[str, Any]:
    """Gemma 3's fields as llama.cpp reads them from its GGUF: the windowed layers (every
    `sliding_window_pattern`-th layer global, 6 when unnamed; none without a window), the
    local RoPE base (``rope.freq_base_swa``, the global base and its scaling being the plain
    keys), the logit soft-cap, and the attention scale, which GGUF does not carry: llama.cpp
    uses 1/sqrt(head_dim), and 1/sqrt(hidden / heads) for the 62-layer 27B (the values of
    every Gemma 3's ``query_pre_attn_scalar``)."""
    if get("attn_logit_softcapping", None):
        raise ModelLoadError(f"{path}: gemma3 with attention logit soft-capping is not "
                             "supported")
    layers = int(get("block_count"))
    types = None
    if window is not None:
        pattern = get("attention.sliding_window_pattern", _GEMMA3_PATTERN)
        if isinstance(pattern, list):  # one flag a layer: True = windowed
            windowed = [bool(p) for p in pattern]
        else:
            windowed = [int(pattern) == 0 or i % int(pattern) < int(pattern) - 1
                        for i in range(layers)]
        if len(windowed) != layers:
            raise ModelLoadError(f"{path}: sliding_window_pattern names {len(windowed)} "
                                 f"layers, the model has {layers}")
        types = tuple("sliding_attention" if w else "full_attention" for w in windowed)
    softcap = get("final_logit_softcapping", None)
    return {
        "layer_types": types,
        "rope_local_theta": float(get("rope.freq_base_swa", _GEMMA3_LOCAL_BASE)),
        "query_pre_attn_scalar": float(hidden // num_heads if layers == 62 else head_dim),
        "final_logit_softcapping": None if not softcap else float(softcap),
    }


def _hf_name(name: str, arch: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    layer_names = _ARCH_LAYER_NAMES.get(arch) or _LAYER_NAMES
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    return None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (rows of each head interleaved for its rope)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(reader: Any, path: Path, config: ModelConfig,
                 dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor in `dtype`) for every tensor the forward uses.

    Unknown tensor names are skipped (a GGUF may carry extras); missing ones are caught by
    the model's loader, which knows what it needs. Gemma 3's norms come back as HF's w:
    llama.cpp stores 1 + w, and the model adds the one again (in float32 the round trip is
    exact for every stored value >= 0.5, Sterbenz).
    """
    import gguf

    arch = gguf_architecture(reader, path)
    for t in reader.tensors:
        name = _hf_name(t.name, arch)
        if name is None:
            continue
        try:
            array = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} ({t.tensor_type.name}) cannot be dequantized: {exc}"
            ) from exc
        array = np.asarray(array, dtype=np.float32)
        expected_elems = int(np.prod([int(d) for d in t.shape]))
        if array.size != expected_elems:
            raise ModelLoadError(f"{path}: tensor {t.name!r} holds {array.size} values, "
                                 f"its header says {expected_elems} (truncated?)")
        if arch in _PERMUTED_QK and t.name.endswith(("attn_q.weight", "attn_q.bias")):
            array = _unpermute(array, config.num_heads)
        elif arch in _PERMUTED_QK and t.name.endswith(("attn_k.weight", "attn_k.bias")):
            array = _unpermute(array, config.num_kv_heads)
        elif arch == "gemma3" and t.name.endswith("norm.weight"):
            array = array - np.float32(1.0)
        if not array.flags.writeable:  # F32 tensors come straight from the read-only memmap
            array = array.copy()
        yield name, torch.from_numpy(np.ascontiguousarray(array)).to(dtype)


def gguf_tokenizer_metadata(reader: Any, path: Path) -> dict[str, Any]:
    """The tokenizer fields a Tokenizer needs, with GGUF's key names shortened."""
    meta: dict[str, Any] = {
        "architecture": _field(reader, "general.architecture", path, None),
        "model": _field(reader, "tokenizer.ggml.model", path),
        "pre": _field(reader, "tokenizer.ggml.pre", path, None),
        "tokens": _field(reader, "tokenizer.ggml.tokens", path),
        "merges": _field(reader, "tokenizer.ggml.merges", path, None),
        "token_type": _field(reader, "tokenizer.ggml.token_type", path, None),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", path, None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", path, None),
        "scores": _field(reader, "tokenizer.ggml.scores", path, None),
        "unk_token_id": _field(reader, "tokenizer.ggml.unknown_token_id", path, None),
        # absent: None (a SentencePiece vocabulary then adds BOS, as in llama.cpp)
        "add_bos_token": _field(reader, "tokenizer.ggml.add_bos_token", path, None),
        "add_eos_token": bool(_field(reader, "tokenizer.ggml.add_eos_token", path, False)),
        "add_space_prefix": bool(_field(reader, "tokenizer.ggml.add_space_prefix", path, True)),
        "chat_template": _field(reader, "tokenizer.chat_template", path, None),
    }
    return meta
