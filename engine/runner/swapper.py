"""Swapper: the cpu tier's tensors and the execution of the cache manager's swap rounds.

It holds one host tensor per device cache tensor that is indexed by block (K and V of
every layer, plus int8/int4 per-token scale pages: ``KVPages.per_block_tensors``), with
the device pages' shape and dtype per block: pinned memory when the device is a GPU (so
transfers run at full PCIe/NVLink speed and can be asynchronous), plain memory on
CPU-only runs, where the "device" pages are in host memory too and the same code runs.

``execute(rounds)`` performs the rounds of ``KVCacheManager.take_swap_rounds()`` in order,
each as one batched ``kernels.swap_blocks`` per tensor and direction (a gather, one
transfer and a scatter; never a copy per block). On CUDA they are issued on a side stream
that first waits for the work already queued on the compute stream (the previous step
wrote the blocks being swapped out); the compute stream then waits on an event recorded
after them, so the step's forward, which needs the swapped-in blocks (and may overwrite
the swapped-out ones), is ordered after the copies without blocking the host thread
(host-to-device copies stay asynchronous; a device-to-host copy returns when its data has
landed). On CPU everything is synchronous and the stream logic is skipped.

With a disk tier, ``disk`` (engine.runner.disk_io.DiskIO) performs the rounds' disk ops
(``DiskBatch``) in their place: a SAVE reads a host block after the rounds before it
(device-to-host copies have landed when they return), a FILL writes one before the rounds
after it read it.
"""

from __future__ import annotations

import time

import torch

from kvscope import kernels
from kvscope.engine.cache.transfers import DiskBatch, Round


class Swapper:
    def __init__(self, device_tensors: list[torch.Tensor], num_cpu_blocks: int,
                 device: torch.device | None = None) -> None:
        if num_cpu_blocks < 1:
            raise ValueError(f"the cpu tier needs at least one block, got {num_cpu_blocks}")
        self.device_tensors = device_tensors  # may be empty: a group with no pages (below)
        device = device if device is not None else device_tensors[0].device
        self.cuda = device.type == "cuda"
        self.host_tensors = [
            torch.zeros((num_cpu_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=self.cuda)
            for t in device_tensors
        ]
        self.num_cpu_blocks = num_cpu_blocks
        self.bytes_per_block = sum(t[0].numel() * t.element_size() for t in device_tensors)
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.disk = None  # engine.runner.disk_io.DiskIO, when the disk tier is on
        # hybrid cache: this one moves group 0's pages (the full-attention layers'; none for
        # a model windowed in every layer, whose group 0 is bookkeeping only), ``window``
        # group 1's (the windowed layers', between the window pool and its own host pool)
        self.window: Swapper | None = None
        # counters: the step stats' swap figures
        self.blocks_out = 0
        self.blocks_in = 0
        self.batches = 0  # swap_blocks rounds issued (each: one call per tensor and direction)
        self.time_s = 0.0  # host-side time spent issuing (CUDA) or doing (CPU) the copies

    @property
    def host_bytes(self) -> int:
        return self.num_cpu_blocks * self.bytes_per_block

    @torch.inference_mode()
    def execute(self, rounds: list[Round | DiskBatch]) -> None:
        """Perform the rounds in order; the next forward on the compute stream sees them."""
        if not rounds or not self.device_tensors and self.disk is None:
            return  # a group with no pages moves nothing
        t0 = time.perf_counter()
        if self.cuda:
            compute = torch.cuda.current_stream(self.stream.device)
            self.stream.wait_stream(compute)
            with torch.cuda.stream(self.stream):
                self._run(rounds)
            done = torch.cuda.Event()
            done.record(self.stream)
            compute.wait_event(done)
        else:
            self._run(rounds)
        self.time_s += time.perf_counter() - t0

    def _run(self, rounds: list[Round | DiskBatch]) -> None:
        for r in rounds:
            if isinstance(r, DiskBatch):
                if self.cuda:  # the copies queued so far have landed in host memory
                    torch.cuda.current_stream(self.stream.device).synchronize()
                self.disk.perform(r)
                continue
            outs, ins = r
            if outs:
                mapping = torch.tensor(outs, dtype=torch.int64)
                for dev, host in zip(self.device_tensors, self.host_tensors, strict=True):
                    kernels.swap_blocks(dev, host, mapping)
                self.blocks_out += len(outs)
            if ins:
                mapping = torch.tensor(ins, dtype=torch.int64)
                for dev, host in zip(self.device_tensors, self.host_tensors, strict=True):
                    kernels.swap_blocks(host, dev, mapping)
                self.blocks_in += len(ins)
            self.batches += 1

    def stats(self) -> dict[str, float]:
        """Cumulative: blocks copied each way (swaps, write-backs, host hits) and their
        bytes, batched rounds issued, and the time spent on them (both groups' of a
        hybrid cache, summed)."""
        own = self._own_stats()
        if self.window is not None:
            for k, v in self.window._own_stats().items():
                own[k] += v
        return own

    def _own_stats(self) -> dict[str, float]:
        return {
            "copied_out_blocks": self.blocks_out,
            "copied_in_blocks": self.blocks_in,
            "swap_out_bytes": self.blocks_out * self.bytes_per_block,
            "swap_in_bytes": self.blocks_in * self.bytes_per_block,
            "swap_rounds": self.batches,
            "swap_time_s": self.time_s,
        }
