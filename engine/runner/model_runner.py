"""ModelRunner: turns the scheduler's decisions into tensors and runs the model.

It owns the paged KV cache tensors (per layer K and V shaped
``[num_blocks, block_size, num_kv_heads, head_dim]``), and the cpu tier's (a ``Swapper``),
and nothing else of the cache: everything it needs for a step arrives in the
``SchedulerOutput`` (block tables, slot mappings, demotion, swap and copy-on-write
orders). Per step (``run``) it executes the orders, builds the flattened token batch
(input ids, positions, slot mapping, block tables, sequence lengths, cumulative query
lengths), runs the forward with attention going through ``kernels`` (Triton on CUDA, the
torch reference on CPU) and returns logits only for the rows that sample a token.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvscope import kernels
from kvscope.engine import features
from kvscope.engine.cache.spec import KVSpec
from kvscope.engine.model.llama import LlamaModel
from kvscope.engine.runner.compiled import maybe_compiled
from kvscope.engine.runner.cuda_graphs import CudaGraph, DecodeGraphs, Graph
from kvscope.engine.runner.page_format import KVPages
from kvscope.engine.scheduler import ScheduledSeq, SchedulerOutput
from kvscope.kernels import quant
from kvscope.kernels.cpu_attention import StepPlan

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
    # hybrid cache: the sliding-window group's slots [T] and tables [B, max_blocks] (its
    # own pool, engine.cache.window_group), read by the windowed layers; None without one
    window_slot_mapping: torch.Tensor | None = None
    window_block_tables: torch.Tensor | None = None


class PagedAttention:
    """The AttentionBackend for a paged cache: write the step's K/V into their slots
    (quantized for fp8/int8/int4 pages), then attend over each sequence's pages.

    fp8: each layer's per-head scales are calibrated from the K/V of the first step that
    reaches it (the first prefill) unless given with ``set_fp8_scales``; fixed afterwards,
    since codes already written depend on them."""

    def __init__(self, pages: KVPages, scale: float,
                 windows: tuple[int | None, ...] | None = None, hybrid: bool = False) -> None:
        self.pages, self.scale = pages, scale
        # each layer's sliding window (None: full attention)
        self.windows = windows or (None,) * len(pages.k_caches)
        # hybrid cache: windowed layers address the window group's pool (group 1)
        self.group = [int(hybrid and w is not None) for w in self.windows]
        self.k_caches, self.v_caches = pages.k_caches, pages.v_caches
        no_scales = [None] * len(pages.k_caches)
        self.k_scales = pages.k_scales or no_scales
        self.v_scales = pages.v_scales or no_scales
        self.calibrate = [pages.format.kv_cache_dtype == "fp8"] * len(pages.k_caches)
        # Quantized pages hold K and V in a Hadamard-rotated basis (engine.runner.page_format)
        self.rotation = pages.format.rotation(pages.k_caches[0].device)
        self.batch: StepBatch | None = None
        # CPU: the step's attention metadata, built once per batch (kernels.cpu_attention)
        self.use_plan = pages.k_caches[0].device.type == "cpu"
        self._plan: tuple[StepBatch, dict[int, StepPlan | None]] | None = None

    def set_fp8_scales(self, k_scales: list[torch.Tensor], v_scales: list[torch.Tensor]) -> None:
        """Given fp8 scales (per layer: [Hkv] or one value); turns calibration off."""
        for dst, src in zip((*self.k_scales, *self.v_scales), (*k_scales, *v_scales),
                            strict=True):
            dst.copy_(quant.fp8_scale_view(src.to(dst.device), dst.shape[0], dst.device))
        self.calibrate = [False] * len(self.calibrate)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        b = self.batch
        k_scale, v_scale = self.k_scales[layer], self.v_scales[layer]
        rot = self.rotation
        if rot is not None:
            q, k, v = q @ rot, k @ rot, v @ rot
        if self.calibrate[layer]:
            k_scale.copy_(quant.fp8_scale_from(k))
            v_scale.copy_(quant.fp8_scale_from(v))
            self.calibrate[layer] = False
        group = self.group[layer]
        plan = self._step_plan(b, q.device, group, layer)
        if plan is not None:
            out = plan.forward(q, k, v, self.k_caches[layer], self.v_caches[layer],
                               self.scale, k_scale=k_scale, v_scale=v_scale,
                               window=self.windows[layer])
            return out if rot is None else out @ rot.T
        slots, tables = (b.window_slot_mapping, b.window_block_tables) if group else \
            (b.slot_mapping, b.block_tables)
        kernels.reshape_and_cache(k, v, self.k_caches[layer], self.v_caches[layer],
                                  slots, k_scale=k_scale, v_scale=v_scale)
        out = kernels.paged_attention(q, self.k_caches[layer], self.v_caches[layer],
                                      tables, b.seq_lens, b.cu_seqlens_q, self.scale,
                                      k_scale=k_scale, v_scale=v_scale,
                                      window=self.windows[layer])
        return out if rot is None else out @ rot.T

    def _step_plan(self, b: StepBatch, device: torch.device, group: int = 0,
                   layer: int = 0) -> StepPlan | None:
        """The step's CPU plan for a cache group, or None when the step runs the kernels'
        own dispatch; decided and built once per batch and group, not per layer."""
        if self._plan is None or self._plan[0] is not b:
            self._plan = (b, {})
        plans = self._plan[1]
        if group not in plans:
            plan = None
            if self.use_plan and kernels.select_backend(device) == "reference":
                k = self.k_caches[layer]  # a layer of this group: its pool's size
                slots, tables = (b.window_slot_mapping, b.window_block_tables) if group \
                    else (b.slot_mapping, b.block_tables)
                plan = StepPlan(slots, tables, b.seq_lens, b.cu_seqlens_q,
                                k.shape[1], k.shape[0])
            plans[group] = plan
        return plans[group]


def keep_freed_memory() -> None:
    """Stop glibc from returning large freed blocks to the OS.

    Every CPU step allocates and frees multi-MB activations and page gathers; by default
    glibc serves each from a fresh mmap and munmaps it on free, so every step pays page
    faults on all of it again (measured: a 7.8 MB copy took 8.6 ms instead of ~1.6 ms).
    Raising the mmap and trim thresholds keeps that memory in the heap for reuse. Called
    after the model is built: it first hands back what loading freed (the loaded weight
    copies that packing replaced, engine.model.llama) with one ``malloc_trim``."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (e.g. musl): nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.malloc_trim(0)
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, (1 << 31) - 1)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, model_config, spec: KVSpec,
                 device: torch.device, *, enforce_eager: bool | None = None,
                 max_model_len: int | None = None, max_num_seqs: int = 256) -> None:
        """``spec``: the cache's layout (engine.cache.spec), its ``page`` format over this
        model's layers and KV heads (a tensor-parallel rank's: its shard of the heads)."""
        fmt = spec.page
        assert fmt is not None and (fmt.num_layers, fmt.num_kv_heads, fmt.head_dim) == (
            model_config.num_layers, model_config.num_kv_heads, model_config.head_dim), \
            "the spec's page format must be this model's"
        self.model, self.cfg, self.spec = model, model_config, spec
        num_blocks, block_size, mixed = spec.num_blocks, spec.block_size, spec.mixed
        num_window_blocks = spec.num_window_blocks
        # CPU: the torch.compile'd decode forward when asked (enforce_eager False;
        # engine.runner.compiled)
        self.compiled = maybe_compiled(model, device, enforce_eager is not False)
        self.device, self.block_size, self.num_blocks = device, block_size, num_blocks
        if device.type == "cpu":
            keep_freed_memory()
        # the pages of the spec's format (engine.runner.page_format); a mixed arena
        # (engine.runner.mixed_kv) replaces them: one block of each stays as a placeholder
        kv_dtype = fmt.model_dtype  # the model dtype, which "auto" pages use
        # block-quantized formats (engine.runner.block_kv) replace these pages, as a mixed
        # arena does: one placeholder block of 16-bit pages stays
        self.block_kv = None
        if fmt.is_block:
            from kvscope.engine.runner.block_kv import BlockKV, BlockPagedAttention
            from kvscope.kernels.block_quant import block_format

            self.block_kv = BlockKV(block_format(fmt.kv_cache_dtype), model_config.num_layers,
                                    num_blocks, block_size, model_config.num_kv_heads,
                                    model_config.head_dim, kv_dtype, device)
            fmt = dataclasses.replace(fmt, kv_cache_dtype="auto")
        # hybrid cache (engine.cache.window_group): the windowed layers' pages hold the
        # window group's own, smaller pool
        self.num_window_blocks = num_window_blocks
        windows = model_config.layer_windows
        self.kv = fmt.allocate(
            num_blocks if mixed is None and self.block_kv is None else 1, device,
            [num_window_blocks if w is not None else num_blocks for w in windows]
            if num_window_blocks else None)
        self.k_caches, self.v_caches = self.kv.k_caches, self.kv.v_caches
        self.attn = PagedAttention(self.kv, model_config.attn_scale, windows,
                                   hybrid=bool(num_window_blocks))
        self.group = self.attn.group  # each layer's cache group (0: full; 1: window)
        if self.block_kv is not None:
            self.attn = BlockPagedAttention(self.block_kv, model_config.attn_scale,
                                            model_config.head_dim)
        # mixed-precision arena (engine.runner.mixed_kv), ``mixed`` = its layout
        self.mixed_kv = None
        if mixed is not None:
            from kvscope.engine.runner.mixed_kv import MixedKV, MixedPagedAttention

            self.mixed_kv = MixedKV.allocate(mixed, model_config.num_layers, num_blocks, device)
            self.attn = MixedPagedAttention(self.mixed_kv, model_config.attn_scale)
        # CUDA: pure decode steps replay captured graphs unless enforce_eager is True
        # (engine.runner.cuda_graphs), or the features table says they fall back
        # (engine.features: this runner's own features, as built)
        self.graphs: DecodeGraphs | None = None
        on = {name for name, yes in (
            ("CUDA graphs", device.type == "cuda" and enforce_eager is not True),
            ("kv_demotion", mixed is not None), ("block format", self.block_kv is not None),
            ("hybrid KV cache", bool(num_window_blocks)),
            ("not the LlamaModel forward", type(model) is not LlamaModel)) if yes}
        if "CUDA graphs" in on and not features.fallbacks(on, "CUDA graphs"):
            self.graphs = self.decode_graphs(max_model_len or model_config.max_position_embeddings,
                                             max_num_seqs)
        self.swapper = None  # the cpu tier's tensors (engine.runner.swapper)
        num_cpu_blocks, num_window_cpu_blocks = spec.num_cpu_blocks, spec.num_window_cpu_blocks
        if num_cpu_blocks:
            from kvscope.engine.runner.swapper import Swapper

            tensors = self.kv.per_block_tensors
            if num_window_blocks:  # one swapper per cache group, over that group's pages
                per_layer = len(self.group)
                by_group = [[t for i, t in enumerate(tensors) if self.group[i % per_layer] == g]
                            for g in (0, 1)]
                self.swapper = Swapper(by_group[0], num_cpu_blocks, device)
                self.swapper.window = Swapper(by_group[1], num_window_cpu_blocks, device)
            else:
                self.swapper = Swapper(tensors, num_cpu_blocks, device)

    def decode_graphs(self, max_model_len: int, max_num_seqs: int,
                      new_graph: Callable[[object], Graph] = CudaGraph) -> DecodeGraphs:
        """Decode graphs over this runner's model and attention for sequences of up to
        ``max_model_len`` tokens (``new_graph``: the capture seam; tests replay eagerly)."""
        return DecodeGraphs(self.model, self.attn, StepBatch, max_num_seqs=max_num_seqs,
                            max_blocks_per_seq=-(-max_model_len // self.block_size),
                            device=self.device, new_graph=new_graph)

    def run(self, out: SchedulerOutput, keep_rows: list[int] | None = None
            ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One step: the output's orders (demotions, swap rounds, copy-on-write copies, in
        that order), then, when it schedules anything, the forward (``execute_keeping``:
        the sampling rows' logits and the hidden states of ``keep_rows``); (None, None)
        for a step that schedules nothing."""
        self.demote(out.demotions)
        if self.swapper is not None:
            self.swapper.execute(out.swap_rounds)
            if out.window_swap_rounds:  # the window group's pages (hybrid cache)
                self.swapper.window.execute(out.window_swap_rounds)
        self.copy_blocks(out.copies)
        if out.window_copies:  # the window group's pages (hybrid cache, one rank only)
            self.copy_blocks(out.window_copies, group=1)
        if out.is_empty:
            return None, None
        return self.execute_keeping(self.prepare(out.scheduled), keep_rows)

    def prepare(self, scheduled: list[ScheduledSeq]) -> StepBatch:
        bs = self.block_size
        ids: list[int] = []
        slot_list: list[int] = []
        starts = np.empty(len(scheduled), dtype=np.int64)
        lens_q = np.empty(len(scheduled), dtype=np.int64)
        for i, s in enumerate(scheduled):
            start, n = s.start, s.num_new_tokens
            ids.extend(s.seq.token_ids_between(start, start + n))
            slot_list += s.slot_mapping
            starts[i], lens_q[i] = start, n
        cu = np.zeros(len(scheduled) + 1, dtype=np.int64)
        np.cumsum(lens_q, out=cu[1:])
        total = int(cu[-1])
        # positions, vectorised: token j of sequence i sits at starts[i] + j
        positions = np.arange(total, dtype=np.int64) - np.repeat(cu[:-1], lens_q) + \
            np.repeat(starts, lens_q)
        max_blocks = max(len(s.block_table) for s in scheduled)
        table = np.zeros((len(scheduled), max_blocks), dtype=np.int64)
        for i, s in enumerate(scheduled):
            table[i, :len(s.block_table)] = s.block_table
        slots = np.asarray(slot_list, dtype=np.int64)
        window_slots = window_table = None
        if self.num_window_blocks:  # the window group's slots and tables (its own pool)
            window_slots = np.asarray([x for s in scheduled for x in s.window_slot_mapping],
                                      dtype=np.int64)
            window_table = np.zeros((len(scheduled), max_blocks), dtype=np.int64)
            for i, s in enumerate(scheduled):
                window_table[i, :len(s.window_table)] = s.window_table
        if self.mixed_kv is not None:  # slots address page codes; tokens go to full pages
            pages = slots // bs
            if total and bool((pages & 3).any()):
                raise RuntimeError("a token was scheduled into a demoted (quantized) page")
            slots = self.mixed_kv.frames_of(pages) * bs + slots % bs
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
            window_slot_mapping=None if window_slots is None else t(window_slots, torch.int64),
            window_block_tables=None if window_table is None else t(window_table, torch.int32),
        )

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> torch.Tensor:
        """Run the forward; returns fp32 logits [R, vocab] for the sampling rows."""
        return self.execute_keeping(batch, None)[0]

    @torch.inference_mode()
    def execute_keeping(self, batch: StepBatch, rows: list[int] | None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``execute``, also returning the final hidden states of the flattened-batch
        ``rows`` (prompt positions whose logprobs a request asked for); turn them into
        logits with ``logits_of`` a slice at a time (a whole prompt's logits is
        tokens x vocab floats)."""
        hidden = self.graphs.run(batch) if self.graphs is not None and rows is None else None
        if hidden is None:
            hidden = self._eager_forward(batch)
        kept = hidden[torch.as_tensor(rows, dtype=torch.int64, device=hidden.device)] \
            if rows else None
        if batch.sample_index.numel() == 0:
            return hidden.new_empty((0, self.cfg.vocab_size), dtype=torch.float32), kept
        return self.model.compute_logits(hidden[batch.sample_index]).float(), kept

    def _eager_forward(self, batch: StepBatch) -> torch.Tensor:
        self.attn.batch = batch
        if self.compiled is not None:  # one token per sequence: a pure decode step
            pure_decode = batch.input_ids.shape[0] == batch.seq_lens.shape[0]
            return self.compiled(batch.input_ids, batch.positions, self.attn, pure_decode)
        return self.model.forward(batch.input_ids, batch.positions, self.attn)

    @torch.inference_mode()
    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, vocab] of final hidden states [N, hidden]."""
        return self.model.compute_logits(hidden).float()

    def demote(self, orders: list[tuple[int, int]]) -> None:
        """Execute the cache manager's demotion orders (page codes), before copy-on-write."""
        if orders:
            self.mixed_kv.demote(orders)

    @torch.inference_mode()
    def copy_blocks(self, orders: list[tuple[int, int]], group: int = 0) -> None:
        """Execute copy-on-write orders (src -> dst) before the step that needs them (mixed
        arena: page codes of full-precision pages); ``group``: the cache group whose
        layers' pages they address (hybrid cache)."""
        if orders and self.num_window_blocks:
            layers = [i for i, g in enumerate(self.group) if g == group]
            if not layers:
                return
            mapping = torch.tensor(orders, dtype=torch.int64, device=self.device)
            per_token = self.kv.format.scale_params > 0

            def pick(ts: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
                return None if ts is None or not per_token else [ts[i] for i in layers]

            kernels.copy_blocks([self.k_caches[i] for i in layers],
                                [self.v_caches[i] for i in layers], mapping,
                                k_scales=pick(self.kv.k_scales), v_scales=pick(self.kv.v_scales))
            return
        if orders and self.block_kv is not None:
            self.block_kv.copy(orders)
        elif orders and self.mixed_kv is not None:
            frames = self.mixed_kv.frames_of(np.asarray(orders, dtype=np.int64))
            self.mixed_kv.copy(frames.tolist())
        elif orders:
            mapping = torch.tensor(orders, dtype=torch.int64, device=self.device)
            per_token = self.kv.format.scale_params > 0  # int8/int4 scales move with pages
            kernels.copy_blocks(self.k_caches, self.v_caches, mapping,
                                k_scales=self.kv.k_scales if per_token else None,
                                v_scales=self.kv.v_scales if per_token else None)
