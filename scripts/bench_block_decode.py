"""Side-by-side CPU decode step time of block-quantized pages (kivi4, k8v4, kivi2) against
float32 pages, in ONE process, passes alternating, same tokens: every variant is a
ModelRunner over the default model holding ``--seqs`` sequences of ``--context`` tokens
(prefilled once), then each pass times ``--steps`` decode steps (one token per sequence)
of every variant in turn (wall time, and process CPU time of all threads: steadier on a
shared box, where wall time mostly measures waiting for a core). A variant ``NAME-torch``
is format NAME read by the torch path (dequantized gathers + SDPA) instead of
kernels/cpu_block_decode.c: the before/after of the C reader. A variant ``NAME-split`` is
the C reader with the rotations of q, k, v and the output and the residual writes done in
torch around it (the path before they moved into the C call). Prints ms per decode step
per pass, the medians and their ratios to the first variant (float32 pages), the process
CPU ms per step spent inside the attention backend (all layers: what the formats change;
the rest of the step is the same model work for every variant), and the load average;
nothing is asserted.

    .venv/bin/python scripts/bench_block_decode.py [--seqs 8] [--context 512] [--steps 4]
        [--passes 5] [--variants auto,kivi4,k8v4,kivi2,kivi4-split,kivi4-torch]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _runner(name: str, model, cfg, seqs: int, context: int, total: int):  # noqa: ANN001, ANN202
    import torch

    from kvscope.engine.runner.kv_budget import spec_of
    from kvscope.engine.runner.model_runner import ModelRunner, StepBatch

    dtype = name.removesuffix("-torch").removesuffix("-split")
    bs = 16
    per_seq = (total + bs - 1) // bs
    runner = ModelRunner(model, cfg, spec_of(dtype, torch.float32, cfg, bs, seqs * per_seq),
                         torch.device("cpu"))
    tables = torch.arange(seqs * per_seq, dtype=torch.int32).view(seqs, per_seq)
    g = torch.Generator().manual_seed(0)
    for s in range(seqs):  # prefill each sequence's context
        ids = torch.randint(0, 1000, (context,), generator=g)
        runner.execute(StepBatch(
            input_ids=ids, positions=torch.arange(context),
            slot_mapping=s * per_seq * bs + torch.arange(context), block_tables=tables[s:s + 1],
            seq_lens=torch.tensor([context], dtype=torch.int32),
            cu_seqlens_q=torch.tensor([0, context], dtype=torch.int32),
            sample_index=torch.tensor([context - 1])))
    if name.endswith("-split"):
        runner.attn.fused = False
    return runner, tables, per_seq * bs


class _Timed:
    """The runner's attention backend, adding each call's process CPU time to ``spent``."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.spent = inner, 0.0

    def __getattr__(self, name: str):  # noqa: ANN204 - batch, fused, ... of the backend
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value) -> None:  # noqa: ANN001
        if name in ("inner", "spent"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def __call__(self, *args):  # noqa: ANN002, ANN204
        c0 = time.process_time()
        try:
            return self.inner(*args)
        finally:
            self.spent += time.process_time() - c0


def _decode(runner, tables, span: int, pos: int):  # noqa: ANN001, ANN202
    import torch

    from kvscope.engine.runner.model_runner import StepBatch

    seqs = tables.shape[0]
    return runner.execute(StepBatch(
        input_ids=torch.full((seqs,), 42), positions=torch.full((seqs,), pos),
        slot_mapping=torch.arange(seqs) * span + pos, block_tables=tables,
        seq_lens=torch.full((seqs,), pos + 1, dtype=torch.int32),
        cu_seqlens_q=torch.arange(seqs + 1, dtype=torch.int32),
        sample_index=torch.arange(seqs)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", default="auto,kivi4,k8v4,kivi2,kivi4-split,kivi4-torch")
    args = p.parse_args()
    import torch

    from kvscope.engine.model import load_model
    from kvscope.engine.runner import block_kv
    from kvscope.kernels import cpu_block_decode

    torch.set_num_threads(args.threads)
    model, _, cfg = load_model("smollm2", device="cpu", dtype=torch.float32)
    names = args.variants.split(",")
    total = args.context + args.steps * args.passes + 1
    with torch.inference_mode():
        runners = {n: _runner(n, model, cfg, args.seqs, args.context, total) for n in names}
        native = cpu_block_decode.supports
        times: dict[str, list[float]] = {n: [] for n in names}
        cpu: dict[str, list[float]] = {n: [] for n in names}
        attn: dict[str, list[float]] = {n: [] for n in names}
        timed = {}
        for n in names:
            runner = runners[n][0]
            timed[n] = runner.attn = _Timed(runner.attn)
        print("bench block decode: prefilled", file=sys.stderr, flush=True)
        load_at_start = os.getloadavg()  # of the timed passes (the prefill comes first)
        pos = args.context
        for _ in range(args.passes):
            for n in names:
                # NAME-torch: the torch path, by refusing the C reader for this variant
                block_kv.cpu_block_decode.supports = (lambda *_: False) if n.endswith(
                    "-torch") else native
                runner, tables, span = runners[n]
                timed[n].spent = 0.0
                t0, c0 = time.perf_counter(), time.process_time()
                for i in range(args.steps):
                    _decode(runner, tables, span, pos + i)
                times[n].append((time.perf_counter() - t0) / args.steps * 1e3)
                cpu[n].append((time.process_time() - c0) / args.steps * 1e3)
                attn[n].append(timed[n].spent / args.steps * 1e3)
            pos += args.steps
        block_kv.cpu_block_decode.supports = native
    base = statistics.median(times[names[0]])
    cpu_base = statistics.median(cpu[names[0]])
    result = {"seqs": args.seqs, "context": args.context, "steps": args.steps,
              "passes": args.passes, "threads": args.threads, "load_at_start": load_at_start,
              "ms_per_step": {n: [round(t, 1) for t in ts] for n, ts in times.items()},
              "median_ms": {n: round(statistics.median(ts), 1) for n, ts in times.items()},
              f"ratio_to_{names[0]}": {n: round(statistics.median(ts) / base, 3)
                                       for n, ts in times.items()},
              "cpu_ms_per_step": {n: [round(t, 1) for t in ts] for n, ts in cpu.items()},
              "median_cpu_ms": {n: round(statistics.median(ts), 1) for n, ts in cpu.items()},
              f"cpu_ratio_to_{names[0]}": {n: round(statistics.median(ts) / cpu_base, 3)
                                           for n, ts in cpu.items()},
              "attention_cpu_ms_per_step": {n: [round(t, 1) for t in ts]
                                            for n, ts in attn.items()},
              "median_attention_cpu_ms": {n: round(statistics.median(ts), 1)
                                          for n, ts in attn.items()},
              f"attention_cpu_ratio_to_{names[0]}": {
                  n: round(statistics.median(ts) / statistics.median(attn[names[0]]), 3)
                  for n, ts in attn.items()},
              "load_at_end": os.getloadavg()}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
