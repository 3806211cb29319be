"""Pure-decode steps replayed from CUDA graphs (issue 18; vLLM's and nano-vllm's capture).

Why: a small-batch decode step launches ~15 kernels per layer, each only microseconds of
GPU work; eagerly, the host's launch overhead is the step. A graph replays the whole forward
with one launch.

How:
  * static input buffers sized for the largest bucket (token ids, positions, slots, block
    tables ``[max_bucket, max_blocks_per_seq]``, sequence lengths, cu_seqlens_q), shared by
    every bucket; a bucket of size b reads their first b rows.
  * a decode step of n sequences runs in the smallest bucket b >= n
    (``GRAPH_BUCKETS``). Its rows are copied into the buffers; rows n..b are padding: token 0
    at position 0, slot -1 (the cache write skips it), sequence length 1 over block 0 (a
    read of one key already in the cache, never a write), so their outputs are finite and
    discarded. Block-table columns past a row's pages may hold older steps' ids: the
    kernels read only the pages below each row's length.
  * each bucket is captured on its first use, from that step's own inputs: two eager
    warm-up forwards (Triton compiles here, outside the capture), then the capture, then the
    replay that produces the step. The warm-ups write the step's K/V into the same slots the
    replay writes again, with the same values. All graphs share one memory pool; they are
    only ever replayed one at a time.
  * the attention kernels size their launch from shapes alone (a table as wide as
    ``max_model_len``: the decode splits cover the longest possible sequence), so a
    graph is valid for any lengths and tables that fit its bucket.

Runs eagerly instead (``run`` returns None): steps with a prompt chunk, more sequences
than the largest bucket, a table wider than ``max_model_len`` allows, while fp8 pages
still calibrate their scales on a first prefill (a capture would freeze the calibration),
and every step after a capture failed (one warning; an error of the forward itself, in a
warm-up, is the eager step's error too and says so again there).
The runner decides when graphs apply at all: CUDA, ``enforce_eager`` not True (the
default), a plain paged cache (not the mixed-precision arena), one rank.

Invariant: for the real rows, a replayed step computes the same forward as the eager step
on the same batch, writing the same K/V slots; the decode attention may split the keys
differently (its splits follow the table width), so values agree to rounding.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import torch

from kvscope.engine.model.llama import LlamaModel

log = logging.getLogger(__name__)

# vLLM's capture sizes: 1, 2, 4, then every multiple of 8 (up to the engine's max_num_seqs).
GRAPH_BUCKETS = (1, 2, 4, *range(8, 513, 8))
WARMUP_RUNS = 2  # eager forwards before a capture (Triton's compile, the allocator's caches)


class Graph(Protocol):
    """One captured forward: ``capture(fn)`` records ``fn`` and returns its output tensor,
    whose contents ``replay()`` recomputes from whatever the input buffers hold then."""

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class CudaGraph:
    """``Graph`` over ``torch.cuda.CUDAGraph``, in the given memory pool."""

    def __init__(self, pool) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up off the capture stream, as torch advises
            for _ in range(WARMUP_RUNS):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = forward()
        return out

    def replay(self) -> None:
        self.graph.replay()


class DecodeGraphs:
    """Captured pure-decode forwards, one per bucket, over shared static input buffers.

    ``attn`` is the runner's AttentionBackend; each forward hands it a ``StepBatch`` of
    buffer views (``make_batch``). ``new_graph(pool)`` builds a ``Graph`` (CudaGraph on a
    GPU; tests give a double that replays by calling the forward again).
    """

    def __init__(self, model: LlamaModel, attn, make_batch: Callable[..., object], *,
                 max_num_seqs: int, max_blocks_per_seq: int, device: torch.device,
                 new_graph: Callable[[object], Graph] = CudaGraph, pool=None) -> None:
        self.model, self.attn, self.make_batch = model, attn, make_batch
        self.buckets = tuple(b for b in GRAPH_BUCKETS if b < max_num_seqs) + \
            (next(b for b in GRAPH_BUCKETS if b >= min(max_num_seqs, GRAPH_BUCKETS[-1])),)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.new_graph = new_graph
        if pool is None and device.type == "cuda":
            pool = torch.cuda.graph_pool_handle()
        self.pool = pool
        n = self.buckets[-1]

        def buf(dtype, *shape, fill=0):
            return torch.full(shape, fill, dtype=dtype, device=device)

        self.input_ids = buf(torch.int64, n)
        self.positions = buf(torch.int64, n)
        self.slot_mapping = buf(torch.int64, n, fill=-1)
        self.block_tables = buf(torch.int32, n, max_blocks_per_seq)
        self.seq_lens = buf(torch.int32, n, fill=1)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[Graph, torch.Tensor]] = {}
        self.capture_seconds: dict[int, float] = {}
        self.replays = 0
        self.enabled = True  # False after a failed capture: every step eager from then on

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def run(self, batch) -> torch.Tensor | None:
        """The final hidden states ``[n, hidden]`` of a pure decode step from its bucket's
        graph (captured now if this is the bucket's first step); None when the step must
        run eagerly (module docstring)."""
        n, width = batch.block_tables.shape
        if batch.input_ids.shape[0] != n or width > self.max_blocks_per_seq or \
                any(getattr(self.attn, "calibrate", ())):
            return None
        bucket = self.bucket_for(n)
        if bucket is None or not self.enabled:
            return None
        self._load(batch, n, bucket)
        if bucket not in self.graphs and not self._capture(bucket):
            return None
        graph, out = self.graphs[bucket]
        graph.replay()
        self.replays += 1
        return out[:n]

    def _load(self, batch, n: int, bucket: int) -> None:
        """The step's rows into the buffers, rows n..bucket as padding."""
        width = batch.block_tables.shape[1]
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.slot_mapping[:n].copy_(batch.slot_mapping)
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.block_tables[:n, :width].copy_(batch.block_tables)
        if n < bucket:
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.slot_mapping[n:bucket].fill_(-1)
            self.seq_lens[n:bucket].fill_(1)
            self.block_tables[n:bucket, 0].zero_()

    def _forward(self, bucket: int) -> torch.Tensor:
        self.attn.batch = self.make_batch(
            input_ids=self.input_ids[:bucket], positions=self.positions[:bucket],
            slot_mapping=self.slot_mapping[:bucket], block_tables=self.block_tables[:bucket],
            seq_lens=self.seq_lens[:bucket], cu_seqlens_q=self.cu_seqlens_q[:bucket + 1],
            sample_index=self.input_ids[:0])
        return self.model.forward(self.input_ids[:bucket], self.positions[:bucket], self.attn)

    def _capture(self, bucket: int) -> bool:
        """Capture ``bucket``; on any failure turn graphs off for good (one warning) and
        let the step run eagerly: the warm-ups only wrote what the eager step writes."""
        t0 = time.perf_counter()
        try:
            graph = self.new_graph(self.pool)
            out = graph.capture(lambda: self._forward(bucket))
        except Exception as e:  # noqa: BLE001 (a capture failure must never stop the engine)
            self.enabled = False
            log.warning("capturing the decode forward for %d sequence(s) failed (%s: %s); "
                        "decoding eagerly from now on", bucket, type(e).__name__,
                        str(e).splitlines()[0] if str(e) else "")
            return False
        self.graphs[bucket] = (graph, out)
        self.capture_seconds[bucket] = time.perf_counter() - t0
        log.info("captured the decode forward for %d sequence(s) in %.2f s", bucket,
                 self.capture_seconds[bucket])
        return True
