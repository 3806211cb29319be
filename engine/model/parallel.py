"""Tensor-parallel Llama: one rank's shard of the weights and its forward, the way vLLM,
SGLang and nano-vllm shard Llama (Megatron's layout).

    qkv      column-parallel: rank r holds query heads [r*H/N, (r+1)*H/N) and KV heads
             [r*KV/N, (r+1)*KV/N) (GQA groups are contiguous, so its queries use its KVs)
    o_proj   row-parallel: the columns of its query heads; partial sums, all-reduce
    gate_up  column-parallel: rows [r*I/N, (r+1)*I/N) of gate and of up
    down     row-parallel: the matching columns; all-reduce
    embed    vocab-parallel: rows [r*V'/N, (r+1)*V'/N) (V' = V padded to a multiple of N);
             a rank looks up only its ids, zeros elsewhere; all-reduce
    lm_head  vocab-parallel: each rank its slice of the logits; all-gather, cut to V

Norms and rope are replicated. Each rank's attention sees only its heads, so its paged KV
pool holds KV/N heads; block tables are the same on every rank (the cache manager runs
once, on rank 0). ``check_divisible`` is the start-up check for head counts.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from kvscope.engine.model.config import ModelConfig
from kvscope.engine.model.llama import LayerWeights, LlamaModel


def check_divisible(config: ModelConfig, world: int) -> None:
    """A clear start-up error when the model cannot be split ``world`` ways (as vLLM)."""
    bad = [f"{name}={n}" for name, n in (("num_attention_heads", config.num_heads),
                                         ("num_key_value_heads", config.num_kv_heads),
                                         ("intermediate_size", config.intermediate_size))
           if n % world]
    if bad:
        raise ValueError(
            f"tensor_parallel_size={world} does not divide the model's {', '.join(bad)}; "
            f"choose a size that divides the KV head count ({config.num_kv_heads})")


def local_config(config: ModelConfig, world: int) -> ModelConfig:
    """One rank's view: its heads and its slice of the MLP (head_dim unchanged)."""
    return dataclasses.replace(config, num_heads=config.num_heads // world,
                               num_kv_heads=config.num_kv_heads // world,
                               intermediate_size=config.intermediate_size // world)


def _vocab_rows(vocab: int, world: int, rank: int) -> tuple[int, int]:
    per = -(-vocab // world)
    return rank * per, (rank + 1) * per


def _vocab_slice(w: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    lo, hi = _vocab_rows(w.shape[0], world, rank)
    part = w[lo:min(hi, w.shape[0])]
    if part.shape[0] < hi - lo:  # the padded tail of the last rank
        part = torch.cat([part, part.new_zeros(hi - lo - part.shape[0], w.shape[1])])
    return part


def shard_weights(model: LlamaModel, world: int, rank: int) -> dict:
    """Rank ``rank``'s tensors (contiguous copies, on the model's device)."""
    cfg, hd = model.config, model.config.head_dim
    qh, kvh, inter = cfg.num_heads // world, cfg.num_kv_heads // world, \
        cfg.intermediate_size // world
    layers = []
    for lw in model.dense_layers():
        q, k, v = lw.qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        rows = [q[rank * qh * hd:(rank + 1) * qh * hd], k[rank * kvh * hd:(rank + 1) * kvh * hd],
                v[rank * kvh * hd:(rank + 1) * kvh * hd]]
        bias = None
        if lw.qkv_bias is not None:
            bq, bk, bv = lw.qkv_bias.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
            bias = torch.cat([bq[rank * qh * hd:(rank + 1) * qh * hd],
                              bk[rank * kvh * hd:(rank + 1) * kvh * hd],
                              bv[rank * kvh * hd:(rank + 1) * kvh * hd]]).contiguous()
        gate, up = lw.gate_up.chunk(2)
        sl = slice(rank * inter, (rank + 1) * inter)
        layers.append(LayerWeights(
            input_norm=lw.input_norm.clone(), qkv=torch.cat(rows).contiguous(), qkv_bias=bias,
            o_proj=lw.o_proj[:, rank * qh * hd:(rank + 1) * qh * hd].contiguous(),
            post_norm=lw.post_norm.clone(),
            gate_up=torch.cat([gate[sl], up[sl]]).contiguous(),
            down=lw.down[:, sl].contiguous(),
            q_norm=None if lw.q_norm is None else lw.q_norm.clone(),  # per head: unsharded
            k_norm=None if lw.k_norm is None else lw.k_norm.clone()))
    embed = _vocab_slice(model.embed, world, rank).contiguous()
    tied = model.tied_lm_head
    lm_head = embed if tied else _vocab_slice(model.lm_head, world, rank).contiguous()
    return {"layers": layers, "embed": embed, "lm_head": lm_head,
            "final_norm": model.final_norm.clone()}


class ShardedLlama(LlamaModel):
    """The forward of one rank. Every rank must call ``forward``/``compute_logits`` with
    the same inputs in the same order (rank 0 broadcasts them): the collectives pair up."""

    def __init__(self, full_config: ModelConfig, shard: dict, world: int, rank: int,
                 device: torch.device | str, group=None) -> None:  # noqa: ANN001
        def to(t):  # noqa: ANN001, ANN202
            return None if t is None else t.to(device)

        layers = [LayerWeights(**{f.name: to(getattr(lw, f.name))
                                  for f in dataclasses.fields(LayerWeights)})
                  for lw in shard["layers"]]
        embed = to(shard["embed"])
        lm_head = embed if shard["lm_head"] is shard["embed"] else to(shard["lm_head"])
        super().__init__(local_config(full_config, world), embed, layers,
                         to(shard["final_norm"]), lm_head)
        self.full_config, self.world, self.rank, self.group = full_config, world, rank, group
        self.vocab_lo, self.vocab_hi = _vocab_rows(full_config.vocab_size, world, rank)

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Row-parallel outputs are partial sums: add them up over the ranks."""
        dist.all_reduce(partial, group=self.group)
        return partial

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding: each rank looks up the ids in its row range (zeros
        elsewhere) and the all-reduce assembles the full rows."""
        mine = (input_ids >= self.vocab_lo) & (input_ids < self.vocab_hi)
        local = torch.where(mine, input_ids - self.vocab_lo, torch.zeros_like(input_ids))
        return self._reduce(self.embed[local] * mine.unsqueeze(-1).to(self.embed.dtype))

    forward = LlamaModel.forward  # the same layers; the hooks above differ
    __call__ = forward

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        part = self.lm_head_linear(hidden).contiguous()
        parts = [torch.empty_like(part) for _ in range(self.world)]
        dist.all_gather(parts, part, group=self.group)
        return torch.cat(parts, dim=-1)[:, :self.full_config.vocab_size].float()
