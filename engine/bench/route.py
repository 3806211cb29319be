"""`kvscope bench route`: the router's policies side by side, on real replica processes.

For each replica count N (``--replicas 2,3,4``), each workload (``multi_turn``,
``doc_qa``) and each policy (prefix, least-load, round-robin), one pass: N fresh replicas
(empty caches) on loopback, a ``kvscope route`` in front, the same seeded sessions driven
through it by the load generator (``engine.loadgen``). Per pass it prints the cluster-wide
prefix hit rate (sum of every response's ``usage.prompt_tokens_details.cached_tokens``
over its prompt tokens), the router's predicted cached tokens against those actual ones,
completed requests, output tokens/s, TTFT p50/p99 (client side, streamed) and how the
requests spread over the replicas. The policies of one (N, workload) run back to back,
in an order that rotates with ``--repeats``, so they see the same machine.

``--stand-in``: replicas serve ``--model stand-in:smollm2`` (everything real but the
forward pass, which sleeps for the real model's measured per-step cost on one core; see
engine/model/stand_in.py), so N=4 fits on a 2-core machine. Without it each replica runs
the real model with ``cpu_count // N`` threads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx

from kvscope.engine.loadgen.summary import parse_metrics, percentile


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("route", help="router policies side by side on N replicas")
    p.add_argument("--replicas", default="2,3,4", help="replica counts, e.g. 2,4")
    p.add_argument("--workloads", default="multi_turn,doc_qa")
    p.add_argument("--policies", default="prefix,least-load,round-robin")
    p.add_argument("--stand-in", action="store_true",
                   help="replicas with a timed stand-in forward (see engine/model/stand_in.py)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per pass")
    p.add_argument("--rate", type=float, default=None,
                   help="sessions/s (default: 0.5 per replica)")
    p.add_argument("--max-tokens", type=int, default=None, help="default: the workload's")
    p.add_argument("--num-gpu-blocks", type=int, default=160, help="KV blocks per replica")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object per pass")
    p.set_defaults(func=run)


def _launch_replicas(n: int, args: argparse.Namespace) -> list[Any]:
    from kvscope.engine.router.data_parallel import Child, free_port, free_port_pair

    threads = 1 if args.stand_in else max(1, (os.cpu_count() or 1) // n)
    children = []
    for i in range(n):
        argv = [sys.executable, "-m", "kvscope.engine.cli", "serve",
                *(["--model", "stand-in:smollm2", "--served-model-name", "smollm2"]
                  if args.stand_in else []),
                "--port", str(free_port()), "--events", f"tcp://127.0.0.1:{free_port_pair()}",
                "--num-gpu-blocks", str(args.num_gpu_blocks), "--max-model-len", "2048",
                "--max-num-seqs", "8", "--log-level", "error"]
        children.append(Child(i, argv, {"OMP_NUM_THREADS": str(threads)}, quiet=True))
    for c in children:
        c.launch()
    for c in children:
        c.ready.wait(600)
        if not c.url:
            _stop(children)
            raise RuntimeError(f"replica r{c.index} did not start")
    return children


def _stop(children: list[Any]) -> None:
    for c in children:
        if c.proc is not None and c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    for c in children:
        if c.proc is not None:
            try:
                c.proc.wait(60)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()


def _launch_router(children: list[Any], policy: str) -> Any:
    from kvscope.engine.router.data_parallel import Child

    argv = [sys.executable, "-m", "kvscope.engine.cli", "route", "--port", "0", "--policy", policy]
    for c in children:
        argv += ["--replica", f"{c.url},{c.events},{c.snapshot}"]
    router = Child(-1, argv, {}, quiet=True, ready_re=r"kvscope route: ready on (http://\S+)")
    router.launch()
    router.ready.wait(120)
    if not router.url:
        _stop([router])
        raise RuntimeError("the router did not start")
    end = time.monotonic() + 60
    while time.monotonic() < end:
        st = httpx.get(router.url + "/router/replicas", timeout=10).json()["replicas"]
        if all(r["in_rotation"] and r["block_size"] for r in st):
            break
        time.sleep(0.2)
    return router


def one_pass(n: int, workload: str, policy: str, args: argparse.Namespace) -> dict[str, Any]:
    from kvscope.engine.loadgen.runner import run_sessions
    from kvscope.engine.loadgen.workloads import load_workload, sessions

    w = load_workload(workload)
    rate = args.rate or 0.5 * n
    todo = sessions(w, seed=args.seed, rate=rate, duration=args.duration,
                    max_tokens=args.max_tokens)
    children = _launch_replicas(n, args)
    router = None
    try:
        router = _launch_router(children, policy)
        t0 = time.perf_counter()
        state = asyncio.run(run_sessions(router.url, todo, concurrency=2 * n,
                                         duration=args.duration, max_wait_s=120.0))
        elapsed = time.perf_counter() - t0
        routed = parse_metrics(httpx.get(router.url + "/metrics", timeout=10).text)
        spread = httpx.get(router.url + "/router/replicas", timeout=10).json()["replicas"]
    finally:
        if router is not None:
            _stop([router])
        _stop(children)
    ok = [r for r in state.records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    return {
        "replicas": n, "workload": workload, "policy": policy,
        "mode": "stand-in" if args.stand_in else "real",
        "requests": len(state.records), "ok": len(ok),
        "hit_rate": cached / prompt if prompt else 0.0,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "predicted_cached_tokens": int(routed.get(
            "kvscope:router_predicted_cached_tokens_total", 0)),
        "output_tok_s": sum(r.completion_tokens for r in ok) / elapsed,
        "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
        "elapsed_s": elapsed, "spread": [r["routed"] for r in spread],
    }


def _row(r: dict[str, Any]) -> str:
    def s(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    return (f"| {r['replicas']} | {r['workload']} | {r['policy']} | {r['mode']} | "
            f"{r['ok']}/{r['requests']} | {r['hit_rate']:.1%} | "
            f"{r['predicted_cached_tokens']}/{r['cached_tokens']} | "
            f"{r['output_tok_s']:.1f} | {s(r['ttft_p50_s'])} | {s(r['ttft_p99_s'])} | "
            f"{'/'.join(map(str, r['spread']))} |")


HEADER = ("| N | workload | policy | replicas | ok/requests | hit rate | predicted/actual "
          "cached | out tok/s | TTFT p50 s | TTFT p99 s | requests per replica |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def run(args: argparse.Namespace) -> int:
    ns = [int(x) for x in args.replicas.split(",")]
    workloads = args.workloads.split(",")
    policies = args.policies.split(",")
    if not args.json:
        print(f"# kvscope bench route: {'stand-in' if args.stand_in else 'real'} replicas, "
              f"{args.duration:g} s of arrivals per pass, {args.num_gpu_blocks} KV blocks "
              "per replica", flush=True)
        print(HEADER, flush=True)
    results = []
    for rep in range(args.repeats):
        for n in ns:
            for workload in workloads:
                k = rep % len(policies)
                for policy in policies[k:] + policies[:k]:
                    r = one_pass(n, workload, policy, args)
                    results.append(r)
                    print(json.dumps(r) if args.json else _row(r), flush=True)
    if not args.json:
        _ratios(results)
    return 0


def _ratios(results: list[dict[str, Any]]) -> None:
    """Prefix vs round-robin per (N, workload): hit-rate ratio and TTFT p50."""
    by = {}
    for r in results:
        by.setdefault((r["replicas"], r["workload"], r["policy"]), []).append(r)
    for (n, w, p), rs in sorted(by.items()):
        if p != "prefix" or (n, w, "round-robin") not in by:
            continue
        rr = by[(n, w, "round-robin")]
        hp = sum(x["hit_rate"] for x in rs) / len(rs)
        hr = sum(x["hit_rate"] for x in rr) / len(rr)
        tp = [x["ttft_p50_s"] for x in rs if x["ttft_p50_s"] is not None]
        tr = [x["ttft_p50_s"] for x in rr if x["ttft_p50_s"] is not None]
        ratio = f"{hp / hr:.2f}x" if hr else "inf"
        print(f"N={n} {w}: prefix hit rate {hp:.1%} vs round-robin {hr:.1%} ({ratio}); "
              f"TTFT p50 {min(tp, default=float('nan')):.2f} s vs "
              f"{min(tr, default=float('nan')):.2f} s", flush=True)
