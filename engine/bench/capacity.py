"""`kvscope bench capacity`: paged vs contiguous KV allocation, side by side in one run;
with ``--hybrid``, a sliding-window model's hybrid KV cache (engine.cache.window_group) vs
every layer keeping every block (``--disable-hybrid-kv-cache-manager``), both paged.

Same model, same KV memory budget in bytes (``--budget-tokens`` tokens of every layer),
same workload for both arms. The workload: N requests submitted at once, prompt and output
lengths drawn from a seeded lognormal mix (prompts: median 200 tokens, sigma 0.9, clipped
to 20..1500, or all ``--prompt-len`` tokens; outputs: median 80, sigma 0.8, clipped to
10..400, or all ``--output-len``), random token ids, greedy, ignore_eos, so every request
produces exactly its drawn output length under both arms.

Measured per engine step: running sequences, allocated KV slots (used blocks x block
size), tokens actually held (sum of computed tokens of running sequences) and allocated KV
bytes (each group's used blocks times its layers' bytes a block). Waste is the
step-time-weighted share of allocated slots holding no token (of the full-attention
layers' pool under the hybrid cache); KV bytes per sequence the mean over engine steps of
allocated bytes over running sequences (a count: it does not depend on the machine).
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
    p.add_argument("--prompt-len", type=int, default=None,
                   help="every prompt this many tokens (default: the lognormal mix)")
    p.add_argument("--output-len", type=int, default=None,
                   help="every output this many tokens (default: the lognormal mix)")
    p.add_argument("--hybrid", action="store_true",
                   help="a windowed model: hybrid KV cache vs keeping every block (both "
                   "paged) instead of paged vs contiguous")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="smollm2",
                   help="smollm2, a .gguf file, an HF dir or dummy:<preset> (dummy:llama-3-8b,"
                   " dummy:gemma-3-1b-kv)")
    p.add_argument("--json", action="store_true", help="print one JSON object only")
    p.add_argument("--plot", metavar="PNG", help="draw both memory timelines")
    p.set_defaults(func=run)


def make_workload(n: int, seed: int, vocab: int, max_model_len: int,
                  prompt_len: int | None = None,
                  output_len: int | None = None) -> list[tuple[list[int], int]]:
    """[(prompt token ids, output length)] drawn from the documented lognormal mix (every
    prompt ``prompt_len``, every output ``output_len`` tokens when given); a prompt is
    shortened when prompt + output would not fit in max_model_len."""
    rng = np.random.default_rng(seed)
    w = WORKLOAD
    plen = np.clip(rng.lognormal(np.log(w["prompt_median"]), w["prompt_sigma"], n),
                   w["prompt_min"], w["prompt_max"]).astype(int)
    if prompt_len is not None:
        plen = np.full(n, prompt_len)
    olen = np.clip(rng.lognormal(np.log(w["output_median"]), w["output_sigma"], n),
                   w["output_min"], w["output_max"]).astype(int)
    if output_len is not None:
        olen = np.full(n, output_len)
    olen = np.minimum(olen, max_model_len // 2)
    plen = np.minimum(plen, max_model_len - olen)
    return [(rng.integers(100, vocab - 100, int(p)).tolist(), int(o))
            for p, o in zip(plen, olen, strict=True)]


# the two arms of each comparison: EngineConfig fields of each
ARMS = {
    "layout": {"paged": {"kv_layout": "paged"}, "contiguous": {"kv_layout": "contiguous"}},
    "hybrid": {"hybrid": {}, "keep_all": {"disable_hybrid_kv_cache_manager": True}},
}


def run_layout(arm: dict[str, Any], workload, args, loaded) -> dict[str, Any]:
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.engine import LLMEngine
    from kvscope.engine.runner.page_format import page_format
    from kvscope.engine.sampling_params import SamplingParams

    model, mc = loaded[0], loaded[2]
    budget = args.budget_tokens // args.block_size * page_format(
        "auto", model.dtype, mc, args.block_size).bytes_per_block
    eng = LLMEngine(EngineConfig(
        model=args.model, block_size=args.block_size, kv_cache_memory_bytes=budget,
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=False, seed=args.seed, **arm), loaded=loaded)
    # one block of one layer; the gpu pool's blocks span the full-attention layers only
    # when a window group holds the windowed ones
    layer_bytes = eng.page_format.bytes_per_block // mc.num_layers
    window = eng.cache.window
    n_win = sum(w is not None for w in mc.layer_windows) if window is not None else 0
    full_bytes, win_bytes = layer_bytes * (mc.num_layers - n_win), layer_bytes * n_win
    for i, (ids, out_len) in enumerate(workload):
        eng.add_request(f"r{i}", {"prompt_token_ids": ids},
                        SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
    # (t, running, allocated, held, KV bytes)
    timeline: list[tuple[float, int, int, int, int]] = []
    generated = 0
    t0 = time.perf_counter()
    bs = args.block_size
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                generated += sum(len(c.token_ids) for c in out.outputs)
        running = eng.scheduler.running
        used = eng.cache.metrics()["tiers"]["gpu"]["used"]
        kv_bytes = used * full_bytes + (window.pool.num_used_blocks * win_bytes if window
                                        else 0)
        held = sum(s.num_computed_tokens for s in running)
        timeline.append((time.perf_counter() - t0, len(running), used * bs, held, kv_bytes))
    wall = time.perf_counter() - t0
    eng.close()
    t = np.array(timeline, dtype=np.float64)
    dt = np.diff(np.concatenate([[0.0], t[:, 0]]))
    alloc, held = t[:, 2], t[:, 3]
    waste = float(np.sum(dt * (alloc - held)) / max(np.sum(dt * alloc), 1e-9))
    busy = t[:, 1] > 0
    per_seq = float(np.mean(t[busy, 4] / t[busy, 1])) if busy.any() else 0.0
    return {"peak_running": int(t[:, 1].max()), "waste_pct": 100 * waste,
            "kv_mib_per_seq": per_seq / 2**20, "kv_budget_mib": budget / 2**20,
            "tokens_per_s": generated / wall, "generated_tokens": generated,
            "wall_s": wall, "steps": len(timeline),
            "preemptions": eng.scheduler.num_preemptions, "timeline": timeline}


def plot(results: dict[str, dict], budget: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 6.5), sharey=True)
    for ax, (layout, r) in zip(axes, results.items(), strict=True):
        t = np.array(r["timeline"])[:, :4]
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

    from kvscope.engine.model import load_model

    loaded = load_model(args.model, device="cpu" if not torch.cuda.is_available() else "cuda",
                        dtype=torch.float32 if not torch.cuda.is_available() else torch.bfloat16)
    mc = loaded[2]
    if args.hybrid and not mc.windowed:
        raise SystemExit(f"--hybrid needs a model with sliding-window layers; {args.model} "
                         "has none")
    workload = make_workload(args.num_requests, args.seed, mc.vocab_size,
                             args.max_model_len, args.prompt_len, args.output_len)
    arms = ARMS["hybrid" if args.hybrid else "layout"]
    results = {}
    for name, arm in arms.items():
        if not args.json:
            print(f"running {name} ...", flush=True)
        results[name] = run_layout(arm, workload, args, loaded)
    (a, p), (b, c) = results.items()
    summary = {
        "model": args.model, "budget_tokens": args.budget_tokens,
        "budget_mib": round(p["kv_budget_mib"], 1), "max_model_len": args.max_model_len,
        "block_size": args.block_size, "num_requests": args.num_requests,
        "prompt_len": args.prompt_len, "output_len": args.output_len, "workload": WORKLOAD,
        "seed": args.seed,
        f"{a}_peak_running": p["peak_running"], f"{b}_peak_running": c["peak_running"],
        "concurrency_ratio": p["peak_running"] / max(c["peak_running"], 1),
        f"{a}_kv_mib_per_seq": round(p["kv_mib_per_seq"], 1),
        f"{b}_kv_mib_per_seq": round(c["kv_mib_per_seq"], 1),
        f"{a}_waste_pct": round(p["waste_pct"], 2), f"{b}_waste_pct": round(c["waste_pct"], 2),
        f"{a}_tokens_per_s": round(p["tokens_per_s"], 1),
        f"{b}_tokens_per_s": round(c["tokens_per_s"], 1),
        "throughput_ratio": p["tokens_per_s"] / max(c["tokens_per_s"], 1e-9),
        f"{a}_preemptions": p["preemptions"], f"{b}_preemptions": c["preemptions"],
        f"{a}_wall_s": round(p["wall_s"], 1), f"{b}_wall_s": round(c["wall_s"], 1),
    }
    if args.plot:
        plot(results, args.budget_tokens, args.plot)
    print(json.dumps(summary, indent=None if args.json else 2))
    return 0
