"""`kvscope bench demotion`: full-precision, uniform int8, uniform int4 and demoted
(mixed-precision) pages at ONE KV memory budget, on the doc_qa and multi_turn workloads.

Per page configuration, in process (no server, so the numbers are the engine's alone):

- workloads (assets/workloads, engine.loadgen.workloads: the same sessions for every config):
  ``--sessions`` sessions, at most ``--concurrency`` in flight (closed loop: a session's
  next turn is queued when its previous answer is done, the answer joining the history),
  greedy. Reported: mean and peak running sequences per step, prefix hit rate
  (hit / query tokens), preemptions, evictions, demoted blocks, generated tokens per wall
  second, and the share of requests whose greedy output equals the full-precision run's.
- accuracy, teacher-forced exactly as ``kvscope bench quant`` (GPL-3 text, ``--tokens``,
  ``--chunk``-token chunks; perplexity ratio and top-1 agreement against full-precision
  pages). For demotion, after every chunk each full block older than ``--hot-window``
  tokens is demoted -- the worst case the policy allows: every cold block in one target
  format, a row per ``--targets`` entry (``demotion@int8``, ``demotion@int4``,
  ``demotion@kivi4``, ...: what a chain reaches when its first format is not enough).

Full precision is the model dtype (fp32 on CPU); uniform int8/int4 are the single-format
quantized pools of issue 6 (Hadamard-rotated); demotion's int8/int4 pages are not rotated,
its block-quantized pages (kivi4, k8v4, kivi2) are, as the formats define them. Several
``--demotion`` chains, separated by ``;``, give a workload row each (``demotion=<chain>``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

UNIFORM = ("full", "int8", "int4")
TARGETS = ("int8", "int4", "kivi4", "k8v4", "kivi2")
WORKLOADS = ("doc_qa", "multi_turn")


def configs(demotion: str) -> list[str]:
    """The workload rows: the uniform pools, then one per ``;``-separated demotion chain."""
    return [*UNIFORM, *(f"demotion={c.strip()}" for c in demotion.split(";") if c.strip())]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demotion", help="mixed-precision pages vs uniform formats at one "
                                        "KV budget: capacity, hit rate, preemptions, accuracy")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--budget-mib", type=float, default=64.0, help="KV memory for every config")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--demotion", default="int8,int4",
                   help="--kv-demotion of config (d); chains separated by ';' get a row each, "
                        "e.g. 'int8,int4;int8,kivi4'")
    p.add_argument("--targets", default=",".join(TARGETS),
                   help="demotion formats of the teacher-forced accuracy rows")
    p.add_argument("--hot-window", type=int, default=256)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("--tokens", type=int, default=2048,
                   help="teacher-forced tokens (0: skip the accuracy part)")
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print one JSON object only")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from kvscope.engine.model import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, device="cpu", dtype=torch.float32)
    t0 = time.perf_counter()
    budget = int(args.budget_mib * (1 << 20))
    result: dict[str, Any] = {"budget_bytes": budget, "block_size": args.block_size,
                              "demotion": args.demotion, "hot_window": args.hot_window,
                              "sessions": args.sessions, "concurrency": args.concurrency}
    for name in (w for w in args.workloads.split(",") if w.strip()):  # "": accuracy only
        rows: dict[str, dict] = {}
        for c in configs(args.demotion):
            rows[c] = run_workload(loaded, name, c, args, budget)
            _log(f"{name} {c}: {rows[c]}")
        base = rows["full"].pop("outputs")
        for c in configs(args.demotion):
            if c != "full":
                outs = rows[c].pop("outputs")
                same = sum(outs.get(k) == v for k, v in base.items())
                rows[c]["greedy_same_as_full"] = round(same / max(1, len(base)), 3)
        rows["full"]["greedy_same_as_full"] = 1.0
        result[name] = rows
    if args.tokens >= 2:
        ids = loaded[1].encode(Path(args.text).read_text())[: args.tokens]
        result["accuracy"] = teacher_forced(loaded, ids, args)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
        print(table(result), file=sys.stderr)
    return 0


def _log(msg: str) -> None:
    print(f"bench demotion: {msg}", file=sys.stderr, flush=True)


def engine_config(config: str, args: argparse.Namespace, budget: int) -> dict[str, Any]:
    kw: dict[str, Any] = {"block_size": args.block_size, "kv_cache_memory_bytes": budget,
                          "max_num_seqs": args.concurrency, "seed": args.seed}
    if config in ("int8", "int4"):
        kw["kv_cache_dtype"] = config
    elif config.startswith("demotion="):
        kw.update(kv_demotion=config.split("=", 1)[1], kv_hot_window=args.hot_window)
    return kw


def run_workload(loaded, name: str, config: str, args: argparse.Namespace,
                 budget: int) -> dict[str, Any]:
    """Run the workload's sessions closed-loop through one engine; return its numbers."""
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.engine import LLMEngine
    from kvscope.engine.loadgen.workloads import load_workload, sessions
    from kvscope.engine.sampling_params import SamplingParams

    w = load_workload(name)
    todo = sessions(w, seed=args.seed, rate=1.0, duration=1e9, max_sessions=args.sessions,
                    max_tokens=args.max_tokens)
    tok = loaded[1]
    eng = LLMEngine(EngineConfig(**engine_config(config, args, budget)), loaded=loaded)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    history: dict[int, list[dict[str, str]]] = {}
    turn_of: dict[int, int] = {}
    outputs: dict[str, list[int]] = {}
    pending = list(range(len(todo)))
    active: set[int] = set()

    def submit(i: int) -> None:
        s = todo[i]
        msgs = history.setdefault(i, [{"role": "system", "content": s.system}]
                                  if s.system else [])
        msgs.append({"role": "user", "content": s.turns[turn_of.get(i, 0)]})
        text = tok.apply_chat_template(msgs, True)
        eng.add_request(f"{i}/{turn_of.get(i, 0)}", text, params)

    running, steps, generated = [], 0, 0
    t0 = time.perf_counter()
    try:
        while pending or active:
            while pending and len(active) < args.concurrency:
                i = pending.pop(0)
                active.add(i)
                submit(i)
            for out in eng.step():
                if not out.finished:
                    continue
                i, t = (int(x) for x in out.request_id.split("/"))
                ids = list(out.outputs[0].token_ids)
                outputs[out.request_id] = ids
                generated += len(ids)
                history[i].append({"role": "assistant", "content": tok.decode(ids)})
                turn_of[i] = t + 1
                if turn_of[i] < len(todo[i].turns):
                    submit(i)
                else:
                    active.discard(i)
            steps += 1
            running.append(eng.stats.running)
        wall = time.perf_counter() - t0
        m = eng.cache.metrics()
        return {
            "kv_blocks": eng.runner.num_blocks if eng.mixed is None else None,
            "kv_frames": eng.runner.num_blocks if eng.mixed is not None else None,
            "mean_running": round(sum(running) / max(1, len(running)), 2),
            "peak_running": max(running, default=0),
            "prefix_hit_rate": round(m["prefix_hit_rate"], 4),
            "preemptions": eng.scheduler.num_preemptions,
            "evictions": m["evictions"], "demoted_blocks": m["demoted_blocks"],
            "requests": len(outputs), "generated_tokens": generated, "steps": steps,
            "wall_s": round(wall, 2), "gen_tok_per_s": round(generated / wall, 2),
            "outputs": outputs,
        }
    finally:
        eng.close()


def teacher_forced(loaded, ids: list[int], args: argparse.Namespace) -> dict[str, dict]:
    """Perplexity ratio and top-1 agreement vs full-precision pages, bench quant's way."""
    import torch
    import torch.nn.functional as F

    from kvscope.engine.runner.kv_budget import spec_of
    from kvscope.engine.runner.mixed_kv import MixedKV
    from kvscope.engine.runner.model_runner import ModelRunner, StepBatch
    from kvscope.kernels import mixed_pages as mp

    model, _, cfg = loaded
    bs, n = args.block_size, len(ids)
    num_blocks = (n + bs - 1) // bs
    cpu = torch.device("cpu")
    runners: dict[str, Any] = {}
    for d in ("full", "int8", "int4"):
        spec = spec_of("auto" if d == "full" else d, torch.float32, cfg, bs, num_blocks)
        runners[d] = ModelRunner(model, cfg, spec, cpu)
    mixed: dict[str, tuple[ModelRunner, MixedKV]] = {}
    for fmt in (t.strip() for t in args.targets.split(",") if t.strip()):
        layout = mp.MixedLayout(torch.float32, bs, cfg.num_kv_heads, cfg.head_dim, (fmt,))
        frames = num_blocks + math.ceil(num_blocks / layout.subs(fmt)) + 1
        r = ModelRunner(model, cfg, spec_of("auto", torch.float32, cfg, bs, frames,
                                            mixed=layout), cpu)
        mixed[fmt] = (r, r.mixed_kv)
        runners[f"demotion@{fmt}"] = r
    codes = {fmt: [kv.layout.code(b, 0, "full") for b in range(num_blocks)]
             for fmt, (_, kv) in mixed.items()}
    tokens = torch.tensor(ids, dtype=torch.int64)
    nll = dict.fromkeys(runners, 0.0)
    agree = dict.fromkeys(runners, 0)
    scored = 0
    for lo in range(0, n - 1, args.chunk):
        hi = min(n, lo + args.chunk)
        rows = hi - lo
        targets = tokens[lo + 1:hi + 1]
        m = targets.numel()
        ref = None
        for d, r in runners.items():
            table = torch.arange(num_blocks, dtype=torch.int32)[None, :]
            if d.startswith("demotion@"):
                table = torch.tensor([codes[d.split("@")[1]]], dtype=torch.int32)
            batch = StepBatch(
                input_ids=tokens[lo:hi], positions=torch.arange(lo, hi),
                slot_mapping=torch.arange(lo, hi), block_tables=table,
                seq_lens=torch.tensor([hi], dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, rows], dtype=torch.int32),
                sample_index=torch.arange(rows))
            logp = F.log_softmax(r.execute(batch)[:m], dim=-1)
            nll[d] += float(-logp.gather(1, targets[:, None]).sum())
            if ref is None:
                ref = logp
            agree[d] += int((logp.argmax(-1) == ref.argmax(-1)).sum())
        scored += m
        # Demote every full block now older than the hot window (what the policy may do).
        cold = max(0, hi - args.hot_window) // bs
        for fmt, (_, kv) in mixed.items():
            lay = kv.layout
            orders = []
            for b in range(cold):
                if codes[fmt][b] & 3 == 0:
                    new = lay.code(num_blocks + b // lay.subs(fmt), b % lay.subs(fmt), fmt)
                    orders.append((codes[fmt][b], new))
                    codes[fmt][b] = new
            kv.demote(orders)
        _log(f"scored {scored}/{n - 1} tokens")
    base = math.exp(nll["full"] / scored)
    return {d: {"ppl": round(math.exp(nll[d] / scored), 4),
                "ppl_ratio": round(math.exp(nll[d] / scored) / base, 5),
                "top1_agreement": round(agree[d] / scored, 5)} for d in runners}


def table(r: dict[str, Any]) -> str:
    lines = []
    for name in WORKLOADS:
        if name not in r:
            continue
        lines.append(f"{name}: config | blocks/frames | mean/peak running | hit rate | "
                     "preemptions | evictions | demoted | gen tok/s | same greedy")
        for c, row in r[name].items():
            lines.append(f"  {c:18s} {row['kv_blocks'] or row['kv_frames']:>6} "
                         f"{row['mean_running']:>6}/{row['peak_running']:<3} "
                         f"{row['prefix_hit_rate']:.3f} {row['preemptions']:>5} "
                         f"{row['evictions']:>6} {row['demoted_blocks']:>6} "
                         f"{row['gen_tok_per_s']:>7} {row['greedy_same_as_full']}")
    for d, a in r.get("accuracy", {}).items():
        lines.append(f"accuracy {d:14s} ppl ratio {a['ppl_ratio']:.5f} top-1 "
                     f"{a['top1_agreement']:.4f}")
    return "\n".join(lines)
