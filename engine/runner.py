"""ModelRunner: turns the scheduler's decisions into tensors and runs the model.

It owns the paged KV cache tensors (per layer K and V shaped
``[num_blocks, block_size, num_kv_heads, head_dim]``) and nothing else of the cache: block
tables come from the cache manager, copy-on-write orders too. Per step it builds the
flattened token batch (input ids, positions, slot mapping, block tables, sequence lengths,
cumulative query lengths), runs the forward with attention going through ``kernels``
(Triton on CUDA, the torch reference on CPU) and returns logits only for the rows that
sample a token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

import kernels
from engine.scheduler import ScheduledSeq

log = logging.getLogger(__name__)


@dataclass
class StepBatch:
    """The tensors of one step; rows of ``sample_index`` are the tokens that sample."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    sample_index: torch.Tensor  # [R] int64, rows of the flattened batch that sample


class PagedAttention:
    """The AttentionBackend for a paged cache: write the step's K/V into their slots,
    then attend over each sequence's pages."""

    def __init__(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                 scale: float) -> None:
        self.k_caches, self.v_caches, self.scale = k_caches, v_caches, scale
        self.batch: StepBatch | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        b = self.batch
        kernels.reshape_and_cache(k, v, self.k_caches[layer], self.v_caches[layer],
                                  b.slot_mapping)
        return kernels.paged_attention(q, self.k_caches[layer], self.v_caches[layer],
                                       b.block_tables, b.seq_lens, b.cu_seqlens_q, self.scale)


def kv_bytes_per_block(cfg, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config, num_blocks: int, block_size: int,
                 device: torch.device, kv_dtype: torch.dtype) -> None:
        self.model, self.cfg = model, model_config
        self.device, self.block_size, self.num_blocks = device, block_size, num_blocks
        shape = (num_blocks, block_size, model_config.num_kv_heads, model_config.head_dim)
        self.k_caches = [torch.zeros(shape, dtype=kv_dtype, device=device)
                         for _ in range(model_config.num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=kv_dtype, device=device)
                         for _ in range(model_config.num_layers)]
        self.attn = PagedAttention(self.k_caches, self.v_caches, model_config.head_dim ** -0.5)

    def prepare(self, scheduled: list[ScheduledSeq],
                block_tables: list[list[int]]) -> StepBatch:
        bs = self.block_size
        ids: list[int] = []
        starts = np.empty(len(scheduled), dtype=np.int64)
        lens_q = np.empty(len(scheduled), dtype=np.int64)
        for i, s in enumerate(scheduled):
            start, n = s.start, s.num_new_tokens
            ids.extend(s.seq.all_token_ids[start:start + n])
            starts[i], lens_q[i] = start, n
        cu = np.zeros(len(scheduled) + 1, dtype=np.int64)
        np.cumsum(lens_q, out=cu[1:])
        total = int(cu[-1])
        # positions and slots, vectorised: token j of sequence i sits at starts[i] + j
        seq_of_token = np.repeat(np.arange(len(scheduled)), lens_q)
        positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1], lens_q) + \
            np.repeat(starts, lens_q)
        max_blocks = max(len(t) for t in block_tables)
        table = np.zeros((len(scheduled), max_blocks), dtype=np.int64)
        for i, t in enumerate(block_tables):
            table[i, :len(t)] = t
        slots = table[seq_of_token, positions // bs] * bs + positions % bs
        seq_lens = starts + lens_q
        sample_rows = [int(cu[i + 1]) - 1 for i, s in enumerate(scheduled) if s.samples]
        dev = self.device

        def t(a, dtype):
            return torch.as_tensor(a, dtype=dtype).to(dev, non_blocking=True)

        return StepBatch(
            input_ids=t(ids, torch.int64), positions=t(positions, torch.int64),
            slot_mapping=t(slots, torch.int64), block_tables=t(table, torch.int32),
            seq_lens=t(seq_lens, torch.int32), cu_seqlens_q=t(cu, torch.int32),
            sample_index=t(sample_rows, torch.int64),
        )

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Run the forward; returns fp32 logits [R, vocab] for the sampling rows."""
        self.attn.batch = batch
        hidden = self.model.forward(batch.input_ids, batch.positions, self.attn)
        if batch.sample_index.numel() == 0:
            return hidden.new_empty((0, self.cfg.vocab_size), dtype=torch.float32)
        return self.model.compute_logits(hidden[batch.sample_index]).float()

    @torch.inference_mode()
    def copy_blocks(self, orders: list[tuple[int, int]]) -> None:
        """Execute copy-on-write orders (src -> dst) before the step that needs them."""
        if orders:
            mapping = torch.tensor(orders, dtype=torch.int64, device=self.device)
            kernels.copy_blocks(self.k_caches, self.v_caches, mapping)
