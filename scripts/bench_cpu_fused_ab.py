"""A/B of the fused native CPU elementwise kernels (kernels/cpu_fused.c: RMSNorm, residual
add + RMSNorm, RoPE) against the torch ops they replace (issue 22), in ONE process, passes
alternating: single-sequence decode, ``LLM.generate`` of one prompt (default 200 tokens) x
128 greedy tokens, TPOT = (generate time - the prompt's prefill time) / (tokens - 1). The
"torch" passes run the same engine with ``kernels.cpu_fused.applies`` patched to False (the
decode attention kernel stays native in both). Then the op-level microbenchmarks at one
token. Prints per-pass numbers, medians and the greedy tokens' agreement; asserts nothing.

    .venv/bin/python scripts/bench_cpu_fused_ab.py [--dtypes float32,bfloat16] [--passes 5]
        [--prompt-len 200] [--tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _timed_generate(llm, ids: list[int],  # noqa: ANN001
                    tokens: int) -> tuple[float, float, list[int]]:
    """(wall s, process CPU s, generated ids) of one generate call."""
    from kvscope.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t0, c0 = time.perf_counter(), time.process_time()
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    return (time.perf_counter() - t0, time.process_time() - c0,
            list(out[0].outputs[0].token_ids))


def _micro(dtype, threads: int) -> list[str]:  # noqa: ANN001
    import torch

    from kvscope.engine.model.llama import rms_norm
    from kvscope.engine.model.rope import RotaryEmbedding
    from kvscope.kernels import cpu_fused

    def best_us(fn, n: int = 2000) -> float:  # noqa: ANN001
        for _ in range(200):
            fn()
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            runs.append((time.perf_counter() - t0) / n * 1e6)
        return min(runs)

    torch.manual_seed(0)
    x, d = torch.randn(1, 576).to(dtype), torch.randn(1, 576).to(dtype)
    w = (1 + 0.1 * torch.randn(576)).to(dtype)
    rope = RotaryEmbedding(64, 100000.0, None, torch.device("cpu"))
    cos, sin = rope.cos_sin(torch.tensor([200]), dtype)
    qkv = torch.randn(1, 15 * 64).to(dtype)
    h = x.clone()
    pairs = [
        ("rms_norm", lambda: rms_norm(x, w, 1e-5), lambda: cpu_fused.rms_norm(x, w, 1e-5)),
        ("residual add + rms_norm", lambda: rms_norm(x + d, w, 1e-5),
         lambda: cpu_fused.add_rms_norm(h, d, w, 1e-5)),
        ("RoPE (12 q+k heads)",
         lambda: RotaryEmbedding.apply(qkv[:, :768].view(1, 12, 64), cos, sin),
         lambda: cpu_fused.rope_(qkv, cos, sin, 12, 64)),
    ]
    rows = []
    for name, torch_fn, native_fn in pairs:
        t, n = best_us(torch_fn), best_us(native_fn)
        rows.append(f"| {str(dtype).removeprefix('torch.')} | {name} | {t:.1f} | {n:.1f} | "
                    f"{t / n:.1f}x |")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    import torch

    from kvscope.engine import LLM
    from kvscope.kernels import cpu_fused

    torch.set_num_threads(args.threads)
    native_applies = cpu_fused.applies
    if cpu_fused.library() is None:
        print("the fused kernels are unavailable (see the log): nothing to compare")
        return 1
    ids = [(j * 7919) % 40000 + 100 for j in range(args.prompt_len)]
    rows, micro = [], []
    print(f"torch threads {torch.get_num_threads()}, load before {os.getloadavg()[0]:.1f}")
    for dtype in args.dtypes.split(","):
        llm = LLM("smollm2", device="cpu", dtype=dtype, enable_prefix_caching=False)
        tpot: dict[str, list[float]] = {"torch": [], "native": []}
        cpu: dict[str, list[float]] = {"torch": [], "native": []}
        outputs: dict[str, list[int]] = {}
        for i in range(args.passes + 1):  # the first pass of each warms up, not counted
            # ABBA order: a load that drifts during a pass does not favour either variant
            for variant in ("torch", "native")[::1 if i % 2 else -1]:
                cpu_fused.applies = native_applies if variant == "native" else (
                    lambda x: False)
                prefill_s, prefill_cpu, _ = _timed_generate(llm, ids, 1)
                total_s, total_cpu, tokens = _timed_generate(llm, ids, args.tokens)
                outputs[variant] = tokens
                tpot[variant].append((total_s - prefill_s) / (args.tokens - 1) * 1e3)
                cpu[variant].append((total_cpu - prefill_cpu) / (args.tokens - 1) * 1e3)
        cpu_fused.applies = native_applies
        llm.llm_engine.close()
        same = outputs["torch"] == outputs["native"]
        med = {v: statistics.median(t[1:]) for v, t in tpot.items()}
        med_cpu = {v: statistics.median(t[1:]) for v, t in cpu.items()}
        for v in ("torch", "native"):
            passes = " ".join(f"{t:.2f}" for t in tpot[v][1:])
            rows.append(f"| {dtype} | {v} | {med[v]:.2f} | {min(tpot[v][1:]):.2f} | "
                        f"{med['torch'] / med[v]:.3f}x | {med_cpu[v]:.2f} | "
                        f"{med_cpu['torch'] / med_cpu[v]:.3f}x | {passes} |")
            print(rows[-1], flush=True)
        print(f"{dtype}: greedy tokens identical torch vs native: {same}; load "
              f"{os.getloadavg()[0]:.1f}", flush=True)
        micro += _micro(getattr(torch, dtype), args.threads)
    print(f"\nsingle-sequence decode, prompt {args.prompt_len} x {args.tokens} tokens, "
          f"{args.threads} threads, TPOT ms (CPU: process CPU time per token, all threads; "
          "the steadier reading on a shared box with --threads 1)\n| dtype | elementwise ops "
          "| median | best | speed-up (median) | CPU median | CPU speed-up | passes |\n"
          "|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print("\nop-level, one token, us per call (best of 5 x 2000)\n| dtype | op | torch ops | "
          "fused kernel | speed-up |\n|---|---|---|---|---|")
    print("\n".join(micro))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
