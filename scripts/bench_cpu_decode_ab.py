"""Side-by-side CPU decode step time of the engine-work variants (issue 22), in ONE process,
passes alternating, same requests: ``before`` (F.linear on row-major weights, attention
metadata rebuilt and validated per layer by kernels.reference), ``packed`` (oneDNN packed
linears only) and ``after`` (packed linears + kernels.cpu_attention.StepPlan). A variant
``attn@REV`` is ``after`` with kernels/cpu_attention.py as it was at git revision REV (A/B
of the CPU attention alone); ``compiled`` (``after`` + the torch.compile'd decode forward,
engine.runner.compiled, enforce_eager=False) and ``compiled-freeze`` (the same with dense
linears traced into the graph and inductor's freezing, which packs them itself). Prints ms
per decode step per pass, the best of each, the best process CPU time per step (all
threads; steadier than wall time on a shared box, best read with --threads 1), the load
average and each compiled variant's compile time; nothing is asserted.

    .venv/bin/python scripts/bench_cpu_decode_ab.py [--seqs 1,32] [--dtypes float32,bfloat16]
        [--steps 10] [--passes 3] [--context 128] [--variants before,packed,after,attn@REV,compiled]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent


def _step_plan_at(rev: str):  # noqa: ANN202
    """kernels.cpu_attention.StepPlan as of git revision ``rev``, loaded as its own module."""
    text = subprocess.run(["git", "-C", str(_ROOT), "show", f"{rev}:kernels/cpu_attention.py"],
                          check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "cpu_attention_at.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"cpu_attention_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module.StepPlan


def _use_step_plan(attn, plan_cls) -> None:  # noqa: ANN001
    """Make this engine's PagedAttention build its per-step plans with ``plan_cls``."""
    def step_plan(b):  # noqa: ANN001, ANN202
        if attn._plan is None or attn._plan[0] is not b:
            k = attn.k_caches[0]
            attn._plan = (b, plan_cls(b.slot_mapping, b.block_tables, b.seq_lens,
                                      b.cu_seqlens_q, k.shape[1], k.shape[0]))
        return attn._plan[1]
    attn._step_plan = step_plan


def _engine(variant: str, dtype: str, seqs: int, context: int):  # noqa: ANN202
    import torch._inductor.config

    from kvscope.engine import LLM, SamplingParams

    os.environ["KVSCOPE_CPU_LINEAR"] = "dense" if variant in ("before", "compiled-freeze") \
        else "packed"
    torch._inductor.config.freezing = variant == "compiled-freeze"
    t0 = time.perf_counter()
    llm = LLM("smollm2", device="cpu", dtype=dtype, num_gpu_blocks=seqs * (context // 16 + 40)
              + 64, enforce_eager=not variant.startswith("compiled"))
    load_s = time.perf_counter() - t0
    os.environ.pop("KVSCOPE_CPU_LINEAR")
    eng = llm.llm_engine
    attn = eng.runner.attn
    attn.use_plan = variant not in ("before", "packed")
    if variant.startswith("attn@"):
        _use_step_plan(attn, _step_plan_at(variant.removeprefix("attn@")))
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    for i in range(seqs):  # distinct prompts (no prefix sharing), lengths 0.5..1.5 x context
        n = context // 2 + (i * 37) % (context + 1)
        eng.add_request(str(i), {"prompt_token_ids": [(i * 7919 + j) % 40000 + 100
                                                      for j in range(n)]}, params)
    while eng.scheduler.waiting or any(
            s.num_computed_tokens < len(s.all_token_ids) - 1 for s in eng.scheduler.running):
        eng.step()
    t0 = time.perf_counter()
    for _ in range(2):
        eng.step()
    torch._inductor.config.freezing = False
    compiled = eng.runner.compiled
    if compiled is not None:
        print(f"{variant} {dtype} seqs={seqs}: engine load {load_s:.1f} s, first decode steps "
              f"{time.perf_counter() - t0:.1f} s, compile s per bucket "
              f"{compiled.compiled_buckets}, enabled={compiled.enabled}", flush=True)
    return eng


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="1,32")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", default="before,packed,after")
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    variants = args.variants.split(",")
    rows = []
    for dtype in args.dtypes.split(","):
        for seqs in (int(s) for s in args.seqs.split(",")):
            engines = {v: _engine(v, dtype, seqs, args.context) for v in variants}
            times: dict[str, list[float]] = {v: [] for v in variants}
            # process CPU time too: on a shared box it moves less than the wall clock (with 1
            # thread it is the step's own work; with 2 it includes OpenMP spin-waits)
            cpu: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(args.passes):
                for v, eng in engines.items():
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(args.steps):
                        eng.step()
                    times[v].append((time.perf_counter() - t0) / args.steps * 1e3)
                    cpu[v].append((time.process_time() - c0) / args.steps * 1e3)
            load = os.getloadavg()[0]
            for eng in engines.values():
                eng.close()
            best = {v: min(t) for v, t in times.items()}
            best_cpu = {v: min(t) for v, t in cpu.items()}
            for v in variants:
                passes = " ".join(f"{t:.1f}" for t in times[v])
                rows.append(f"| {dtype} | {seqs} | {v} | {best[v]:.1f} | "
                            f"{best[variants[0]] / best[v]:.2f}x | {best_cpu[v]:.1f} | "
                            f"{best_cpu[variants[0]] / best_cpu[v]:.2f}x | {passes} | "
                            f"{load:.1f} |")
                print(rows[-1], flush=True)
    print("\n| dtype | seqs | variant | best ms/step | speed-up vs first | best CPU ms/step "
          "| CPU speed-up | passes (ms/step) | load avg |\n|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
