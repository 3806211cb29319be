"""Test helpers: random paged batches built independently of the kernels, and a dense
attention oracle that states the causal rule in the most literal way (per sequence, per
query, explicit mask, float64)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    keys: list[torch.Tensor]  # per sequence dense [seq_len, Hkv, D] (cache dtype values)
    values: list[torch.Tensor]

    def to(self, device: str) -> PagedBatch:
        move = [t.to(device) for t in (self.q, self.k_cache, self.v_cache, self.block_tables,
                                       self.seq_lens, self.cu_seqlens_q)]
        return PagedBatch(*move, self.keys, self.values)


def make_batch(seq_lens: list[int], q_lens: list[int], num_heads: int, num_kv_heads: int,
               head_dim: int, block_size: int, dtype: torch.dtype = torch.float32,
               q_dtype: torch.dtype | None = None, spare_blocks: int = 3,
               seed: int = 0) -> PagedBatch:
    """Sequences scattered over a shuffled page pool; unused table entries point at block 0
    (a real page holding someone else's data), so reading past seq_len shows up as an error.
    """
    gen = torch.Generator().manual_seed(seed)
    pages = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(pages) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    tables = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    keys, values, used = [], [], 0
    for b, n in enumerate(seq_lens):
        ids = perm[used:used + pages[b]]
        used += pages[b]
        tables[b, : pages[b]] = ids.int()
        keys.append(k_cache[ids].flatten(0, 1)[:n].clone())
        values.append(v_cache[ids].flatten(0, 1)[:n].clone())
    total_q = sum(q_lens)
    q = torch.randn(total_q, num_heads, head_dim, generator=gen).to(q_dtype or dtype)
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    return PagedBatch(q, k_cache, v_cache, tables, torch.tensor(seq_lens, dtype=torch.int32),
                      cu, keys, values)


def dense_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """float64 oracle: for each sequence, each query row, each head, an explicit mask."""
    q = batch.q.double()
    out = torch.zeros_like(q)
    num_heads, num_kv_heads = q.shape[1], batch.keys[0].shape[1]
    group = num_heads // num_kv_heads
    cu = batch.cu_seqlens_q.tolist()
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        q_len = cu[b + 1] - cu[b]
        context_len = seq_len - q_len
        k = batch.keys[b].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = batch.values[b].double().repeat_interleave(group, dim=1)
        for i in range(q_len):
            visible = torch.arange(seq_len) < context_len + i + 1
            scores = torch.einsum("hd,lhd->hl", q[cu[b] + i], k) * scale
            scores[:, ~visible] = float("-inf")
            out[cu[b] + i] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), v)
    return out
