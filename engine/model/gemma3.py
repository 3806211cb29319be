"""Gemma 3 (text): the Llama-family layer rearranged. Per layer: a norm before and after
attention and before and after the MLP (the residual adds the post-normed output), RMSNorm
on each head's q and k, RoPE with the global base (and its scaling) on full-attention layers
and the local base on sliding-window layers, a GELU-tanh gated MLP; the embedding scaled by
sqrt(hidden); an optional final logit soft-cap.

Gemma's RMSNorm multiplies by (1 + weight): the loader stores 1 + weight (computed in
float32, as transformers does), so every norm here is the plain ``rms_norm``; in float32 the
result is bit for bit transformers' (in bfloat16 the product rounds once more)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

from kvscope.engine.model.attention import AttentionBackend
from kvscope.engine.model.config import ModelConfig
from kvscope.engine.model.llama import LayerWeights, LlamaModel, rms_norm
from kvscope.engine.model.rope import RotaryEmbedding
from kvscope.kernels import cpu_fused


def _plus_one_norms(tensors: Iterable[tuple[str, torch.Tensor]]
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in tensors:
        if name.endswith("norm.weight"):
            t = (t.float() + 1.0).to(t.dtype)
        yield name, t


class Gemma3Model(LlamaModel):
    """Invariants as LlamaModel's; every norm weight held is Gemma's 1 + weight."""

    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__(config, embed, layers, final_norm, lm_head)
        self.local_rope = RotaryEmbedding(config.rope_dim, config.rope_local_theta or 10000.0,
                                          None, embed.device)
        self.embed_scale = torch.tensor(config.hidden_size ** 0.5).to(embed.dtype)
        self.windowed = [w is not None for w in config.layer_windows]

    @classmethod
    def from_tensors(cls, config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]],
                     source: str, device: torch.device | str) -> Gemma3Model:
        """As LlamaModel.from_tensors, from a checkpoint holding Gemma's norm weights
        (w, applied as 1 + w)."""
        return super().from_tensors(config, _plus_one_norms(tensors), source, device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn: AttentionBackend) -> torch.Tensor:
        cfg = self.config
        num_tokens, eps, d = input_ids.shape[0], cfg.rms_norm_eps, cfg.head_dim
        hidden = self._embed(input_ids)
        rope = {False: self.rope.cos_sin(positions, hidden.dtype),
                True: self.local_rope.cos_sin(positions, hidden.dtype)}
        qk_size, qk_heads = cfg.q_size + cfg.kv_size, cfg.num_heads + cfg.num_kv_heads
        native = cpu_fused.applies(hidden) and cfg.rope_dim == d
        for idx, (layer, lin) in enumerate(zip(self.layers, self.linears, strict=True)):
            qkv = lin.qkv(rms_norm(hidden, layer.input_norm, eps))
            self._qk_norm(qkv, layer, num_tokens)
            cos, sin = rope[self.windowed[idx]]
            if native:
                cpu_fused.rope_(qkv, cos, sin, qk_heads, d)  # in place
                qk = qkv[:, :qk_size].view(num_tokens, qk_heads, d)
            else:
                qk = RotaryEmbedding.apply(qkv[:, :qk_size].view(num_tokens, qk_heads, d),
                                           cos, sin)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, qk_size:].view(num_tokens, cfg.num_kv_heads, d)
            out = attn(idx, q, k, v)
            delta = self._reduce(lin.o_proj(out.reshape(num_tokens, cfg.q_size)))
            hidden = hidden + rms_norm(delta, layer.post_norm, eps)
            gate, up = lin.gate_up(rms_norm(hidden, layer.pre_ff_norm, eps)).chunk(2, dim=-1)
            delta = self._reduce(lin.down(F.gelu(gate, approximate="tanh") * up))
            hidden = hidden + rms_norm(delta, layer.post_ff_norm, eps)
        return rms_norm(hidden, self.final_norm, eps)

    __call__ = forward

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed[input_ids] * self.embed_scale

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
