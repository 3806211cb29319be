"""The Llama-family forward in plain torch: RMSNorm, RoPE, GQA attention through an
AttentionBackend, SwiGLU MLP. Q/K/V and gate/up are fused at load time into one matmul each
(fewer, bigger matmuls), so the HF checkpoint layout exists only while loading."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvscope.engine.model.attention import AttentionBackend
from kvscope.engine.model.config import FUSED_CHECKPOINTS, ModelConfig
from kvscope.engine.model.errors import ModelLoadError
from kvscope.engine.model.linear import Linear, make_linear
from kvscope.engine.model.rope import RotaryEmbedding
from kvscope.kernels import cpu_fused


@dataclass
class LayerWeights:
    """One layer's tensors as loaded. A built ``LlamaModel`` keeps only the norms (and the
    bias) here: its linears (``LayerLinears``) hold the matrices, on CPU packed, so that
    the weights are not in memory twice; ``LlamaModel.dense_layers`` gives them back."""

    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor | None  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size] (Qwen2)
    o_proj: torch.Tensor | None  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden]
    down: torch.Tensor | None  # [hidden, intermediate]
    q_norm: torch.Tensor | None = None  # [head_dim] (Qwen3: config.qk_norm)
    k_norm: torch.Tensor | None = None  # [head_dim]
    pre_ff_norm: torch.Tensor | None = None  # [hidden] (Gemma 3: norms around the MLP)
    post_ff_norm: torch.Tensor | None = None  # [hidden]


@dataclass
class LayerLinears:
    """One layer's linears as chosen at load time (engine.model.linear): oneDNN-packed on
    CPU, F.linear elsewhere. Built from LayerWeights; the linears then own the matrices.
    Invariant: weights are read-only once the model is built."""

    qkv: Linear
    o_proj: Linear
    gate_up: Linear
    down: Linear

    @classmethod
    def of(cls, w: LayerWeights) -> LayerLinears:
        return cls(qkv=make_linear(w.qkv, w.qkv_bias), o_proj=make_linear(w.o_proj),
                   gate_up=make_linear(w.gate_up), down=make_linear(w.down))

    def weights_of(self, norms: LayerWeights) -> LayerWeights:
        """``norms`` with this layer's unpacked matrices filled in."""
        return dataclasses.replace(norms, qkv=self.qkv.weight, o_proj=self.o_proj.weight,
                                   gate_up=self.gate_up.weight, down=self.down.weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers: normalize in float32, cast back, then scale."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(hidden: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 native: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the RMSNorm after it: (hidden + delta, rms_norm of that). Native
    (``kernels.cpu_fused.applies``): one fused kernel that adds into ``hidden`` IN PLACE, so
    ``hidden`` must be the forward's own tensor."""
    if native:
        return hidden, cpu_fused.add_rms_norm(hidden, delta, weight, eps)
    hidden = hidden + delta
    return hidden, rms_norm(hidden, weight, eps)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF-named tensor the forward needs, with its shape (q/k/v and gate/up as the
    checkpoint holds them: fused for FUSED_CHECKPOINTS)."""
    h, i = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.o_proj.weight": (h, config.q_size),
            p + "mlp.down_proj.weight": (h, i),
        }
        if config.architecture in FUSED_CHECKPOINTS:
            shapes |= {p + "self_attn.qkv_proj.weight": (config.q_size + 2 * config.kv_size, h),
                       p + "mlp.gate_up_proj.weight": (2 * i, h)}
        else:
            shapes |= {
                p + "self_attn.q_proj.weight": (config.q_size, h),
                p + "self_attn.k_proj.weight": (config.kv_size, h),
                p + "self_attn.v_proj.weight": (config.kv_size, h),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
            }
        if config.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (config.head_dim,),
                       p + "self_attn.k_norm.weight": (config.head_dim,)}
        if config.architecture == "gemma3_text":
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,),
                       p + "post_feedforward_layernorm.weight": (h,)}
        if config.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (config.q_size,),
                p + "self_attn.k_proj.bias": (config.kv_size,),
                p + "self_attn.v_proj.bias": (config.kv_size,),
            }
    return shapes


class LlamaModel:
    """Stateless apart from weights: all per-sequence state lives in the AttentionBackend."""

    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: torch.Tensor) -> None:
        self.config = config
        self.embed = embed
        self.final_norm = final_norm
        self.linears = [LayerLinears.of(w) for w in layers]
        self.lm_head_linear = make_linear(lm_head)
        self.tied_lm_head = lm_head is embed
        # The linears own the matrices (packed on CPU): drop the loaded copies, else CPU
        # weight memory doubles. ``dense_layers``/``lm_head`` unpack them on demand.
        self.layers = [dataclasses.replace(w, qkv=None, o_proj=None, gate_up=None, down=None)
                       for w in layers]
        self.rope = RotaryEmbedding(config.rope_dim, config.rope_theta, config.rope_scaling,
                                    embed.device)

    @property
    def lm_head(self) -> torch.Tensor:
        """The lm_head weight [vocab, hidden]: the embedding when tied, else unpacked from
        its linear (a copy on CPU; for sharding and tests, not the forward)."""
        return self.embed if self.tied_lm_head else self.lm_head_linear.weight

    def dense_layers(self) -> list[LayerWeights]:
        """Every layer's tensors with unpacked matrices (exact; copies when packed): what
        tensor-parallel sharding reads."""
        return [lin.weights_of(w) for w, lin in zip(self.layers, self.linears, strict=True)]

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @classmethod
    def from_tensors(cls, config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]],
                     source: str, device: torch.device | str) -> LlamaModel:
        """Build from (HF name, tensor) pairs; names not in expected_shapes are ignored.
        A missing tensor or a wrong shape raises ModelLoadError naming `source` and the tensor."""
        shapes = expected_shapes(config)
        found: dict[str, torch.Tensor] = {}
        for name, tensor in tensors:
            if name not in shapes:
                continue
            if tuple(tensor.shape) != shapes[name]:
                raise ModelLoadError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {shapes[name]} from the config")
            found[name] = tensor
        missing = [name for name in shapes if name not in found]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ModelLoadError(f"{source}: missing tensor {missing[0]!r}{more}")

        def take(name: str) -> torch.Tensor:
            return found.pop(name).to(device).contiguous()

        layers = []
        for n in range(config.num_layers):
            p = f"model.layers.{n}."
            fused = config.architecture in FUSED_CHECKPOINTS
            qkv = found.pop(p + "self_attn.qkv_proj.weight") if fused else \
                torch.cat([found.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
            bias = None
            if config.attention_bias:
                bias = torch.cat([found.pop(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
                bias = bias.to(device)
            gate_up = found.pop(p + "mlp.gate_up_proj.weight") if fused else \
                torch.cat([found.pop(p + "mlp.gate_proj.weight"),
                           found.pop(p + "mlp.up_proj.weight")])
            layers.append(LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=qkv.to(device), qkv_bias=bias,
                o_proj=take(p + "self_attn.o_proj.weight"),
                post_norm=take(p + "post_attention_layernorm.weight"),
                gate_up=gate_up.to(device),
                down=take(p + "mlp.down_proj.weight"),
                q_norm=take(p + "self_attn.q_norm.weight") if config.qk_norm else None,
                k_norm=take(p + "self_attn.k_norm.weight") if config.qk_norm else None,
                pre_ff_norm=take(p + "pre_feedforward_layernorm.weight")
                if config.architecture == "gemma3_text" else None,
                post_ff_norm=take(p + "post_feedforward_layernorm.weight")
                if config.architecture == "gemma3_text" else None,
            ))
        embed = take("model.embed_tokens.weight")
        lm_head = embed if config.tie_word_embeddings else take("lm_head.weight")
        return cls(config, embed, layers, take("model.norm.weight"), lm_head)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: LongTensor [T] (tokens of several sequences may be flattened
        together; the backend knows which is which). Returns the final-normed hidden [T, hidden]."""
        cfg = self.config
        num_tokens = input_ids.shape[0]
        hidden = self._embed(input_ids)
        cos, sin = self.rope.cos_sin(positions, hidden.dtype)  # once per step, all layers
        qk_size, qk_heads = cfg.q_size + cfg.kv_size, cfg.num_heads + cfg.num_kv_heads
        # CPU float32/bfloat16: RMSNorm, residual add + RMSNorm and RoPE run as fused C
        # kernels (kernels.cpu_fused: the same math in one call instead of 5-8 small ops)
        native, eps = cpu_fused.applies(hidden), cfg.rms_norm_eps
        norms = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]
        x = (cpu_fused.rms_norm if native else rms_norm)(hidden, self.layers[0].input_norm, eps)
        for idx, (layer, lin) in enumerate(zip(self.layers, self.linears, strict=True)):
            qkv = lin.qkv(x)
            if layer.q_norm is not None:
                self._qk_norm(qkv, layer, num_tokens)
            # q and k are adjacent columns of qkv: rotate them in one pass (heads broadcast)
            if native and cfg.rope_dim == cfg.head_dim:
                cpu_fused.rope_(qkv, cos, sin, qk_heads, cfg.head_dim)  # in place
                qk = qkv[:, :qk_size].view(num_tokens, qk_heads, cfg.head_dim)
            else:
                qk = RotaryEmbedding.apply(
                    qkv[:, :qk_size].view(num_tokens, qk_heads, cfg.head_dim), cos, sin)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, qk_size:].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            out = attn(idx, q, k, v)
            delta = self._reduce(lin.o_proj(out.reshape(num_tokens, cfg.q_size)))
            hidden, x = add_rms_norm(hidden, delta, layer.post_norm, eps, native)
            gate, up = lin.gate_up(x).chunk(2, dim=-1)
            delta = self._reduce(lin.down(F.silu(gate) * up))
            # the residual add and the next layer's input norm (after the last: the final norm)
            hidden, x = add_rms_norm(hidden, delta, norms[idx], eps, native)
        return x

    __call__ = forward

    def _qk_norm(self, qkv: torch.Tensor, layer: LayerWeights, num_tokens: int) -> None:
        """Qwen3: RMSNorm over each head of q and of k, in place in ``qkv``, before RoPE."""
        cfg = self.config
        q = qkv[:, :cfg.q_size].view(num_tokens, cfg.num_heads, cfg.head_dim)
        k = qkv[:, cfg.q_size:cfg.q_size + cfg.kv_size].view(num_tokens, cfg.num_kv_heads,
                                                             cfg.head_dim)
        q.copy_(rms_norm(q, layer.q_norm, cfg.rms_norm_eps))
        k.copy_(rms_norm(k, layer.k_norm, cfg.rms_norm_eps))

    # The two places a tensor-parallel shard differs (engine.model.parallel.ShardedLlama):
    # a vocab-parallel embedding, and summing row-parallel partial outputs over the ranks.
    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed[input_ids]

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T', hidden] (only the rows to sample) -> logits [T', vocab] in float32."""
        return self.lm_head_linear(hidden).float()
