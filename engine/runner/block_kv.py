"""The runner's side of block-quantized pages (``--kv-cache-dtype kivi4 | k8v4 | kivi2``):
the pages of every layer, the residual window, and the attention backend over them.

The numeric formats and the page store are ``kernels.block_quant``. This module owns the
residual window's bookkeeping, shared by all layers: ``slot_of[block]`` names the residual
row that holds a block's tokens while the block is incomplete (-1: complete, read from its
codes). A step's writes go to residual rows (a block met for the first time gets a free
row); a block whose last slot is written in the step is quantized in one go from its row
(``BlockLayer.seal``) and its row is freed after the step's last layer, so within the
step that completes it a block is still read at full precision (as KIVI's prefill).

Limits: a block freed by the cache manager while incomplete (a finished or preempted
sequence) keeps its row until its id is written again from offset 0; rows grow on
demand, at most one per block. Swapping to a host tier is not supported for these formats
(the residual rows would have to travel with their blocks): ``EngineConfig`` refuses the
combination. On the CPU a decode-only step reads the codes in place with
kernels/cpu_block_decode.c and any other step (prefill, mixed, chunked) takes the torch
path (dequantized gathers + SDPA, the reference); on a GPU every step reads them with
kernels/triton_block_attention.py (decode and prefill with cached context alike). The native
float kernels and kernels/triton_attention.py do not read these pages.
"""

from __future__ import annotations

import torch

from kvscope.kernels import block_quant as bq
from kvscope.kernels import cpu_block_decode, quant
from kvscope.kernels.cpu_attention import StepPlan

_FIRST_ROWS = 8


class BlockKV:
    """Every layer's block-quantized pages plus the residual window."""

    def __init__(self, fmt: bq.BlockFormat, num_layers: int, num_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.fmt, self.dtype, self.device = fmt, dtype, device
        self.block_size, self.num_blocks = block_size, num_blocks
        self.shape = (block_size, num_kv_heads, head_dim)
        kd = fmt.packed_dim(fmt.key_bits, head_dim)
        vd = fmt.packed_dim(fmt.value_bits, head_dim)
        k_scale_shape = bq.key_scale_shape(fmt, num_blocks, block_size, num_kv_heads, head_dim)
        self.slot_of = torch.full((num_blocks,), -1, dtype=torch.int64, device=device)
        self.free_rows: list[int] = list(range(_FIRST_ROWS - 1, -1, -1))

        def zeros(shape: tuple[int, ...], dt: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dt, device=device)

        supers = (num_blocks, num_kv_heads, 2)
        self.layers = [bq.BlockLayer(
            fmt, zeros((num_blocks, block_size, num_kv_heads, kd), torch.uint8),
            zeros(k_scale_shape, torch.uint8), zeros(supers, bq.SUPER_DTYPE),
            zeros((num_blocks, block_size, num_kv_heads, vd), torch.uint8),
            zeros((num_blocks, block_size, num_kv_heads, 2), torch.uint8),
            zeros(supers, bq.SUPER_DTYPE),
            zeros((_FIRST_ROWS, *self.shape), dtype), zeros((_FIRST_ROWS, *self.shape), dtype),
            self.slot_of) for _ in range(num_layers)]

    @property
    def rows_in_use(self) -> int:
        return self.layers[0].residual_k.shape[0] - len(self.free_rows)

    def _row(self) -> int:
        if not self.free_rows:  # double every layer's residual rows
            old = self.layers[0].residual_k.shape[0]
            for layer in self.layers:
                grow = torch.zeros((old, *self.shape), dtype=self.dtype, device=self.device)
                layer.residual_k = torch.cat([layer.residual_k, grow])
                layer.residual_v = torch.cat([layer.residual_v, grow.clone()])
            self.free_rows = list(range(2 * old - 1, old - 1, -1))
        return self.free_rows.pop()

    def plan_writes(self, slots: torch.Tensor) -> StepWrites:
        """The residual rows of a step's valid write ``slots`` (assigning rows to blocks met
        for the first time) and the blocks the step completes."""
        blocks = slots // self.block_size
        offsets = slots % self.block_size
        for b in torch.unique(blocks).tolist():
            if int(self.slot_of[b]) < 0:
                self.slot_of[b] = self._row()
        rows = self.slot_of.index_select(0, blocks)
        done = torch.unique(blocks[offsets == self.block_size - 1])
        return StepWrites(rows, offsets, done, self.slot_of.index_select(0, done))

    def release(self, writes: StepWrites) -> None:
        """After the step's last layer: the completed blocks are read from their codes."""
        for b, r in zip(writes.done.tolist(), writes.done_rows.tolist(), strict=True):
            self.slot_of[b] = -1
            self.free_rows.append(r)

    @torch.inference_mode()
    def copy(self, orders: list[tuple[int, int]]) -> None:
        """Copy-on-write: block src -> dst in every layer, codes, scales and residual row."""
        if not orders:
            return
        src = torch.tensor([s for s, _ in orders], dtype=torch.int64, device=self.device)
        dst = torch.tensor([d for _, d in orders], dtype=torch.int64, device=self.device)
        for layer in self.layers:
            for t in (*layer.key_tensors, *layer.value_tensors):
                t.index_copy_(0, dst, t.index_select(0, src))
        for s, d in orders:
            row = int(self.slot_of[s])
            if row < 0:
                if int(self.slot_of[d]) >= 0:  # a stale row of the destination
                    self.free_rows.append(int(self.slot_of[d]))
                    self.slot_of[d] = -1
                continue
            if int(self.slot_of[d]) < 0:
                self.slot_of[d] = self._row()
            new = int(self.slot_of[d])
            for layer in self.layers:
                layer.residual_k[new] = layer.residual_k[row]
                layer.residual_v[new] = layer.residual_v[row]


class StepWrites:
    """One step's writes into the residual window (shared by every layer)."""

    def __init__(self, rows: torch.Tensor, offsets: torch.Tensor, done: torch.Tensor,
                 done_rows: torch.Tensor) -> None:
        self.rows, self.offsets, self.done, self.done_rows = rows, offsets, done, done_rows


class BlockPagedAttention:
    """The AttentionBackend over block-quantized pages: write the step's K/V into the
    residual window, quantize the blocks it completes, attend (decode-only steps: the C
    kernel where it builds; else the step plan's torch path; on a GPU the Triton kernel
    for every step)."""

    def __init__(self, kv: BlockKV, scale: float, head_dim: int) -> None:
        self.kv, self.scale = kv, scale
        self.num_layers = len(kv.layers)
        rot = quant.hadamard(head_dim, kv.dtype, kv.device)
        self.k_rot = rot if kv.fmt.rotate_keys else None
        self.v_rot = rot if kv.fmt.rotate_values else None
        self.batch = None
        self._step: tuple[object, StepPlan, StepWrites] | None = None
        # Decode-only steps in one C call (rotations and residual writes included); False
        # keeps those in torch around the C reader (scripts/bench_block_decode.py's "-split"
        # variants measure the difference).
        self.fused = True

    @staticmethod
    def _on_triton(q: torch.Tensor, pages: bq.BlockLayer) -> bool:
        """Steps on a GPU (every query with a slot) read the codes in place with
        kernels/triton_block_attention.py (its ``supports``); anything else takes the torch
        path."""
        if q.device.type != "cuda":
            return False
        from kvscope.kernels import triton_block_attention

        return triton_block_attention.supports(q, pages)

    def _plan(self) -> tuple[StepPlan, StepWrites]:
        b = self.batch
        if self._step is None or self._step[0] is not b:
            kv = self.kv
            plan = StepPlan(b.slot_mapping, b.block_tables, b.seq_lens, b.cu_seqlens_q,
                            kv.block_size, kv.num_blocks)
            self._step = (b, plan, kv.plan_writes(plan.write_slots))
        return self._step[1], self._step[2]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        plan, writes = self._plan()
        pages = self.kv.layers[layer]
        if self.fused and plan.decode_only and plan.keep is None and \
                writes.rows.numel() == q.shape[0] and k.dtype == torch.float32 and \
                cpu_block_decode.supports(q, pages):
            # One C call rotates q, k, v, writes the residual rows, attends and rotates the
            # output back (kernels/cpu_block_decode.c); the seal reads the rows it wrote.
            out = cpu_block_decode.block_decode(
                q, pages, plan.native_tables, plan.native_lens, self.scale, model_basis=True,
                new=(k, v, writes.rows, writes.offsets))
            pages.seal(writes.done, writes.done_rows)
            if layer == self.num_layers - 1:
                self.kv.release(writes)
            return out.to(q.dtype)
        if self.k_rot is not None:
            q, k = q @ self.k_rot, k @ self.k_rot
        if self.v_rot is not None:
            v = v @ self.v_rot
        kw, vw = (k, v) if plan.keep is None else (k.index_select(0, plan.keep),
                                                     v.index_select(0, plan.keep))
        index = (writes.rows, writes.offsets)
        pages.residual_k.index_put_(index, kw.to(pages.residual_k.dtype))
        pages.residual_v.index_put_(index, vw.to(pages.residual_v.dtype))
        pages.seal(writes.done, writes.done_rows)
        if plan.decode_only and cpu_block_decode.supports(q, pages):
            out = cpu_block_decode.block_decode(q, pages, plan.native_tables, plan.native_lens,
                                                self.scale).to(q.dtype)
        elif plan.keep is None and self._on_triton(q, pages):
            from kvscope.kernels import triton_block_attention  # imports triton: CUDA steps only

            b = self.batch
            out = triton_block_attention.block_attention(q, pages, b.block_tables, b.seq_lens,
                                                      b.cu_seqlens_q, self.scale)
        else:
            given = (k, v) if plan.keep is None else None
            out = plan._attend(q, pages, self.scale, given)
        if layer == self.num_layers - 1:
            self.kv.release(writes)
        return out if self.v_rot is None else out @ self.v_rot.T
