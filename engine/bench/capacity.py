"""`kvscope bench capacity`: paged vs contiguous KV allocation, side by side in one run.

Same model, same KV memory budget, same workload for both layouts. The workload: N
requests submitted at once, prompt and output lengths drawn from a seeded lognormal mix
(prompts: median 200 tokens, sigma 0.9, clipped to 20..1500; outputs: median 80, sigma
0.8, clipped to 10..400), random token ids, greedy, ignore_eos, so every request produces
exactly its drawn output length under both layouts.

Measured per engine step: running sequences, allocated KV slots (used blocks x block
size) and tokens actually held (sum of computed tokens of running sequences). Waste is
the step-time-weighted share of allocated slots holding no token.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

WORKLOAD = {"prompt_median": 200, "prompt_sigma": 0.9, "prompt_min": 20, "prompt_max": 1500,
            "output_median": 80, "output_sigma": 0.8, "output_min": 10, "output_max": 400}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("capacity", help="paged vs contiguous KV allocation, same budget")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--budget-tokens", type=int, default=16384,
                   help="KV budget in tokens for both layouts (default 16384)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="smollm2",
                   help="smollm2, a .gguf file, an HF dir or dummy:<preset> (dummy:llama-3-8b)")
    p.add_argument("--json", action="store_true", help="print one JSON object only")
    p.add_argument("--plot", metavar="PNG", help="draw both memory timelines")
    p.set_defaults(func=run)


def make_workload(n: int, seed: int, vocab: int,
                  max_model_len: int) -> list[tuple[list[int], int]]:
    """[(prompt token ids, output length)] drawn from the documented lognormal mix; a prompt
    is shortened when prompt + output would not fit in max_model_len."""
    rng = np.random.default_rng(seed)
    w = WORKLOAD
    plen = np.clip(rng.lognormal(np.log(w["prompt_median"]), w["prompt_sigma"], n),
                   w["prompt_min"], w["prompt_max"]).astype(int)
    olen = np.clip(rng.lognormal(np.log(w["output_median"]), w["output_sigma"], n),
                   w["output_min"], w["output_max"]).astype(int)
    olen = np.minimum(olen, max_model_len // 2)
    plen = np.minimum(plen, max_model_len - olen)
    return [(rng.integers(100, vocab - 100, int(p)).tolist(), int(o))
            for p, o in zip(plen, olen, strict=True)]


def run_layout(layout: str, workload, args, loaded) -> dict[str, Any]:
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.sampling import SamplingParams

    eng = LLMEngine(EngineConfig(
        model=args.model, kv_layout=layout, block_size=args.block_size,
        num_gpu_blocks=args.budget_tokens // args.block_size, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
        seed=args.seed), loaded=loaded)
    for i, (ids, out_len) in enumerate(workload):
        eng.add_request(f"r{i}", {"prompt_token_ids": ids},
                        SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
    timeline: list[tuple[float, int, int, int]] = []  # (t, running, allocated, held)
    generated = 0
    t0 = time.perf_counter()
    bs = args.block_size
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                generated += sum(len(c.token_ids) for c in out.outputs)
        running = eng.scheduler.running
        allocated = eng.cache.metrics()["tiers"]["gpu"]["used"] * bs
        held = sum(s.num_computed_tokens for s in running)
        timeline.append((time.perf_counter() - t0, len(running), allocated, held))
    wall = time.perf_counter() - t0
    eng.close()
    t = np.array(timeline, dtype=np.float64)
    dt = np.diff(np.concatenate([[0.0], t[:, 0]]))
    alloc, held = t[:, 2], t[:, 3]
    waste = float(np.sum(dt * (alloc - held)) / max(np.sum(dt * alloc), 1e-9))
    return {"peak_running": int(t[:, 1].max()), "waste_pct": 100 * waste,
            "tokens_per_s": generated / wall, "generated_tokens": generated,
            "wall_s": wall, "steps": len(timeline),
            "preemptions": eng.scheduler.num_preemptions, "timeline": timeline}


def plot(results: dict[str, dict], budget: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 6.5), sharey=True)
    for ax, (layout, r) in zip(axes, results.items(), strict=True):
        t = np.array(r["timeline"])
        ax.fill_between(t[:, 0], t[:, 2], step="post", color="#f2a65a", alpha=0.6,
                        label="allocated KV slots")
        ax.fill_between(t[:, 0], t[:, 3], step="post", color="#3c8dbc", alpha=0.9,
                        label="slots holding a token")
        ax.axhline(budget, color="#888", lw=1, ls="--", label="budget")
        ax.set_title(f"{layout}: peak {r['peak_running']} running, "
                     f"waste {r['waste_pct']:.1f}%, {r['tokens_per_s']:.0f} tok/s")
        ax.set_ylabel("KV tokens")
        ax.legend(loc="upper right", fontsize=8)
    axes[-1].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> int:
    import torch

    from engine.model import load_model

    loaded = load_model(args.model, device="cpu" if not torch.cuda.is_available() else "cuda",
                        dtype=torch.float32 if not torch.cuda.is_available() else torch.bfloat16)
    workload = make_workload(args.num_requests, args.seed, loaded[2].vocab_size,
                             args.max_model_len)
    results = {}
    for layout in ("paged", "contiguous"):
        if not args.json:
            print(f"running {layout} layout ...", flush=True)
        results[layout] = run_layout(layout, workload, args, loaded)
    p, c = results["paged"], results["contiguous"]
    summary = {
        "budget_tokens": args.budget_tokens, "max_model_len": args.max_model_len,
        "block_size": args.block_size, "num_requests": args.num_requests,
        "workload": WORKLOAD, "seed": args.seed,
        "paged_peak_running": p["peak_running"],
        "contiguous_peak_running": c["peak_running"],
        "concurrency_ratio": p["peak_running"] / max(c["peak_running"], 1),
        "paged_waste_pct": round(p["waste_pct"], 2),
        "contiguous_waste_pct": round(c["waste_pct"], 2),
        "paged_tokens_per_s": round(p["tokens_per_s"], 1),
        "contiguous_tokens_per_s": round(c["tokens_per_s"], 1),
        "throughput_ratio": p["tokens_per_s"] / max(c["tokens_per_s"], 1e-9),
        "preemptions": p["preemptions"] + c["preemptions"],
        "paged_wall_s": round(p["wall_s"], 1), "contiguous_wall_s": round(c["wall_s"], 1),
    }
    if args.plot:
        plot(results, args.budget_tokens, args.plot)
    print(json.dumps(summary, indent=None if args.json else 2))
    return 0
