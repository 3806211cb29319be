"""Decode attention with and without sliding windows at a long context (issue: the models
people run). Gemma-3-1B's attention shapes (4 query heads, 1 KV head, head_dim 256; 26
layers of which 22 are windowed with W = 512), a batch of decoding sequences at CONTEXT
tokens each, float32 pages of 16 tokens, through the engine's CPU step plan
(kernels.cpu_attention.StepPlan): one layer of each kind timed, alternating passes (full
attention, windowed through the native decode kernel, windowed through the torch path with
window masks: the native kernel declined for that pass), and a decode step's attention
total for the hybrid model vs the same model with every layer global. Only attention
differs between the two: the matmuls are the same. Then one prefill chunk of CHUNK tokens
ending at CONTEXT (the rest cached), one windowed layer: the native prefill kernel with the
window vs the torch path (SDPA over the gathered keys with a window mask), alternating.

    PYTHONPATH=. .venv/bin/python scripts/bench_window_attention.py [--context 8192]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from unittest import mock

import torch

from kvscope.kernels import cpu_native
from kvscope.kernels.cpu_attention import StepPlan

HQ, HKV, D, BS = 4, 1, 256, 16
LAYERS, GLOBAL_LAYERS, WINDOW = 26, 4, 512


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=512)
    args = ap.parse_args()
    torch.manual_seed(0)
    pages_per_seq = -(-args.context // BS)
    nb = args.seqs * pages_per_seq
    k_cache = torch.randn(nb, BS, HKV, D)
    v_cache = torch.randn(nb, BS, HKV, D)
    tables = torch.randperm(nb).view(args.seqs, pages_per_seq).to(torch.int32)
    lens = torch.full((args.seqs,), args.context, dtype=torch.int32)
    cu = torch.arange(args.seqs + 1, dtype=torch.int32)
    slots = (tables[:, -1].long() * BS + (args.context - 1) % BS)
    q = torch.randn(args.seqs, HQ, D)
    k = torch.randn(args.seqs, HKV, D)
    v = torch.randn(args.seqs, HKV, D)

    def layer_ms(window: int | None) -> float:
        plan = StepPlan(slots, tables, lens, cu, BS, nb)
        plan.forward(q, k, v, k_cache, v_cache, D ** -0.5, window=window)  # masks built once
        t0 = time.perf_counter()
        for _ in range(args.reps):
            plan.forward(q, k, v, k_cache, v_cache, D ** -0.5, window=window)
        return (time.perf_counter() - t0) / args.reps * 1e3

    def torch_path_ms(window: int) -> float:
        with mock.patch.object(cpu_native, "supports", lambda k_cache, v_cache: False):
            return layer_ms(window)

    full, windowed, masked = [], [], []
    loads = [os.getloadavg()[0]]
    for _ in range(args.passes):  # alternating
        full.append(layer_ms(None))
        windowed.append(layer_ms(WINDOW))
        masked.append(torch_path_ms(WINDOW))
    loads.append(os.getloadavg()[0])
    f, w, m = (statistics.median(x) for x in (full, windowed, masked))
    hybrid = GLOBAL_LAYERS * f + (LAYERS - GLOBAL_LAYERS) * w
    print(f"load average {loads[0]:.2f} before, {loads[1]:.2f} after; "
          f"{torch.get_num_threads()} threads; "
          f"{args.seqs} sequences at {args.context} tokens, fp32 pages of {BS}")
    for name, med, runs in (("full attention (native kernel)", f, full),
                            (f"window {WINDOW} (native kernel)", w, windowed),
                            (f"window {WINDOW} (torch path, masks)", m, masked)):
        print(f"one layer, {name}: {med:.2f} ms "
              f"(passes {', '.join(f'{x:.2f}' for x in runs)})")
    print(f"windowed layer: native kernel {m / w:.2f}x faster than the torch path")
    print(f"decode step attention, {LAYERS} layers: hybrid {hybrid:.1f} ms vs all global "
          f"{LAYERS * f:.1f} ms ({LAYERS * f / hybrid:.2f}x)")
    prefill(args, k_cache, v_cache, tables[:1], nb)


def prefill(args: argparse.Namespace, k_cache: torch.Tensor, v_cache: torch.Tensor,
            tables: torch.Tensor, nb: int) -> None:
    """One windowed layer attending a prefill chunk after cached context: native vs torch."""
    chunk = args.chunk
    lens = torch.tensor([args.context], dtype=torch.int32)
    cu = torch.tensor([0, chunk], dtype=torch.int32)
    pos = torch.arange(args.context - chunk, args.context)
    slots = tables[0, pos // BS].long() * BS + pos % BS
    q = torch.randn(chunk, HQ, D)
    k = torch.randn(chunk, HKV, D)
    v = torch.randn(chunk, HKV, D)

    def layer_ms() -> float:
        plan = StepPlan(slots, tables, lens, cu, BS, nb)
        plan.forward(q, k, v, k_cache, v_cache, D ** -0.5, window=WINDOW)  # masks built
        t0 = time.perf_counter()
        for _ in range(args.reps):
            plan.forward(q, k, v, k_cache, v_cache, D ** -0.5, window=WINDOW)
        return (time.perf_counter() - t0) / args.reps * 1e3

    native, masked = [], []
    for _ in range(args.passes):
        native.append(layer_ms())
        with mock.patch.object(cpu_native, "supports_prefill", lambda q, kc, vc: False):
            masked.append(layer_ms())
    n, m = statistics.median(native), statistics.median(masked)
    print(f"prefill chunk of {chunk} tokens ending at {args.context}, window {WINDOW}, one "
          f"layer (load {os.getloadavg()[0]:.2f}): native kernel {n:.2f} ms "
          f"(passes {', '.join(f'{x:.2f}' for x in native)}), torch path {m:.2f} ms "
          f"(passes {', '.join(f'{x:.2f}' for x in masked)}): {m / n:.2f}x")

if __name__ == "__main__":
    main()
