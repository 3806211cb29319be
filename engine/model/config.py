"""ModelConfig: the shape of a Llama-family model, independent of the file it came from."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvscope.engine.model.errors import ModelLoadError

# HF `model_type` values whose weights and forward are the Llama layout kvscope implements.
# Qwen2 differs only by q/k/v biases; Mistral is plain Llama plus its sliding window.
# Qwen3 adds a per-head RMSNorm on q and k before RoPE (``qk_norm``).
# Phi-3 fuses q/k/v and gate/up in its checkpoint, may rotate only part of each head
# (``rotary_dim``) and scales RoPE with LongRoPE.
# Gemma 3 (text): its own forward (engine.model.gemma3): sliding-window and global layers
# with separate RoPE bases, four norms a layer, a scaled embedding, a GELU MLP.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")
# Architectures whose checkpoints hold qkv_proj and gate_up_proj already fused.
FUSED_CHECKPOINTS = ("phi3",)
# RoPE variants implemented in engine/model/rope.py.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")


@dataclass(frozen=True)
class ModelConfig:
    """Invariants: hidden_size == num_heads * head_dim is NOT assumed (head_dim is explicit);
    num_heads % num_kv_heads == 0 (GQA groups); rope_scaling is None or has a 'rope_type'
    in SUPPORTED_ROPE_TYPES. ``sliding_window`` W (None: none) means a query at position p
    of a windowed layer attends to keys p-W+1..p only (transformers' sliding attention);
    ``layer_windows`` says which layers are windowed."""

    architecture: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    sliding_window: int | None = None
    qk_norm: bool = False  # RMSNorm over each head's q and k (weights [head_dim]) before RoPE
    rotary_dim: int | None = None  # RoPE rotates the first rotary_dim of each head (None: all)
    # which layers are windowed, HF's spelling ("sliding_attention" | "full_attention");
    # None: every layer is, when sliding_window is set
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # the windowed layers' RoPE base (Gemma 3), unscaled
    query_pre_attn_scalar: float | None = None  # attention scale ** -2 (None: head_dim)
    final_logit_softcapping: float | None = None  # logits = c * tanh(logits / c)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ModelLoadError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.layer_types is not None and (
                len(self.layer_types) != self.num_layers or
                set(self.layer_types) - {"sliding_attention", "full_attention"}):
            raise ModelLoadError(f"layer_types must name {self.num_layers} layers, each "
                                 f"sliding_attention or full_attention, got {self.layer_types}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim
                                                and self.rotary_dim % 2 == 0):
            raise ModelLoadError(f"rotary_dim={self.rotary_dim} must be even and in "
                                 f"(0, head_dim={self.head_dim}]")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type", "default")
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ModelLoadError(
                    f"unsupported rope scaling {rope_type!r} "
                    f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
                )

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window W, or None for full attention."""
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None
                     for t in self.layer_types)

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def windowed(self) -> bool:
        return any(w is not None for w in self.layer_windows)

    @property
    def rope_dim(self) -> int:
        """How many leading dims of each head RoPE rotates."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _eos_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    """Build a ModelConfig from an HF config.json dict (transformers 4.x or 5.x spelling)."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{source}: unsupported architecture {model_type!r} "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    if model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window", False) and cfg.get(
        "sliding_window"
    ):  # Qwen windows only the layers from max_window_layers on: per-layer windows
        raise ModelLoadError(f"{source}: {model_type} with use_sliding_window (a window on "
                             "some layers only) is not supported")
    # Mistral's and Phi-3's `sliding_window` (no `use_sliding_window` flag) windows every layer;
    # Gemma 3's the layers its layer_types name.
    window = cfg.get("sliding_window") if model_type in ("mistral", "phi3", "gemma3_text") \
        else None
    gemma = _gemma3(cfg, source) if model_type == "gemma3_text" else {}
    # transformers 5 folds rope_theta and rope_scaling into one `rope_parameters` dict.
    rope = dict(cfg.get("rope_parameters") or {})
    if "full_attention" in rope:  # per layer type (Gemma 3): the global layers' here
        rope = dict(rope["full_attention"] or {})
    legacy_scaling = cfg.get("rope_scaling")
    if legacy_scaling:
        rope.update(legacy_scaling)
    rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope.pop("type")
    partial_rotary = float(rope.pop("partial_rotary_factor",
                                    cfg.get("partial_rotary_factor", 1.0)))
    rope_scaling = rope if rope.get("rope_type", "default") != "default" else None
    try:
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // num_heads)
        if rope_scaling is not None and rope_scaling["rope_type"] == "longrope":
            rope_scaling = longrope_parameters(rope_scaling, cfg)
        return ModelConfig(
            architecture=model_type,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            # Qwen2 always has q/k/v biases; its config does not say so.
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_tuple(cfg.get("eos_token_id")),
            sliding_window=None if window is None else int(window),
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            rotary_dim=None if partial_rotary == 1.0 else int(head_dim * partial_rotary),
            **gemma,
        )
    except KeyError as exc:
        raise ModelLoadError(f"{source}: config lacks required key {exc.args[0]!r}") from exc
    except ModelLoadError as exc:
        raise ModelLoadError(f"{source}: {exc}") from exc


def longrope_parameters(scaling: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """LongRoPE's parameters made explicit, as transformers derives them: the pretraining
    length (``original_max_position_embeddings``), and the cos/sin scale
    ``attention_factor`` (from ``factor``, by default max_position_embeddings over the
    pretraining length)."""
    scaling = dict(scaling)
    original = scaling.get("original_max_position_embeddings",
                           cfg.get("original_max_position_embeddings"))
    if original is None or "long_factor" not in scaling or "short_factor" not in scaling:
        raise ModelLoadError("longrope scaling needs long_factor, short_factor and "
                             "original_max_position_embeddings")
    original = int(original)
    factor = scaling.get("factor") or int(cfg["max_position_embeddings"]) / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else \
            math.sqrt(1 + math.log(factor) / math.log(original))
    scaling.update(original_max_position_embeddings=original, factor=float(factor),
                   attention_factor=float(attention_factor))
    return scaling


def _gemma3(cfg: dict[str, Any], source: str) -> dict[str, Any]:
    """Gemma 3's own fields: which layers are windowed (``layer_types``, or every
    ``sliding_window_pattern``-th layer global), the windowed layers' RoPE base, the
    attention scale and the logit soft-cap; what this forward lacks is refused by name."""
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{source}: gemma3_text with hidden_activation="
                             f"{cfg['hidden_activation']!r} is not supported")
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if cfg.get(key):
            raise ModelLoadError(f"{source}: gemma3_text with {key}={cfg[key]!r} is not "
                                 "supported")
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        pattern = int(cfg.get("sliding_window_pattern", 6))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                 for i in range(layers)]
    rope = cfg.get("rope_parameters") or {}
    local = (rope.get("sliding_attention") or {}) if "sliding_attention" in rope else {}
    if local.get("rope_type", "default") != "default":
        raise ModelLoadError(f"{source}: scaled RoPE on gemma3_text's sliding layers is not "
                             "supported")
    softcap = cfg.get("final_logit_softcapping")
    return {
        "layer_types": tuple(types),
        "rope_local_theta": float(local.get("rope_theta",
                                            cfg.get("rope_local_base_freq", 10000.0))),
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
        "final_logit_softcapping": None if softcap is None else float(softcap),
    }
