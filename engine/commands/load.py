"""`kvscope load`: run a named, seeded workload against a kvscope (or any OpenAI) server.

    kvscope load --url http://127.0.0.1:8000 --workload shared_system_chat \
                 [--duration S] [--rate R] [--concurrency C] [--num-requests N] [--json]

Workloads live in assets/workloads/ (``--list`` names them). Prints a progress bar, then
a summary (TTFT/TPOT p50/p99, throughput, prefix hit rate, preemptions, swaps), the
server's figures taken from two /metrics scrapes around the run (kvscope's names or
vLLM's: engine.loadgen.summary).
"""

from __future__ import annotations

import argparse
import os


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("load", help="drive a named workload against a running server")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--workload", default="shared_system_chat",
                   help="a name in assets/workloads/ or a .json path")
    p.add_argument("--list", action="store_true", help="list the named workloads and exit")
    p.add_argument("--duration", type=float, default=None, metavar="S",
                   help="start no request after S seconds (default: the workload's)")
    p.add_argument("--rate", type=float, default=None, metavar="R",
                   help="mean new conversations per second (default: the workload's)")
    p.add_argument("--concurrency", type=int, default=None, metavar="C",
                   help="most requests in flight (default: the workload's)")
    p.add_argument("--num-requests", type=int, default=None, metavar="N",
                   help="stop after N requests have started")
    p.add_argument("--max-wait", type=float, default=None, metavar="S",
                   help="cancel requests still running S seconds after --duration "
                        "(default: let them finish)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="override the workload's answer length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model name to send (default: none)")
    p.add_argument("--api-key", default=os.environ.get("KVSCOPE_API_KEY") or None)
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import sys
    import time

    import httpx
    from tqdm import tqdm

    from kvscope.engine.loadgen.runner import RunState, run_sessions
    from kvscope.engine.loadgen.summary import scrape, summarize, table
    from kvscope.engine.loadgen.workloads import (
        WorkloadError,
        list_workloads,
        load_workload,
        sessions,
    )

    if args.list:
        for name in list_workloads():
            print(f"{name:<20} {load_workload(name).description}")
        return 0
    try:
        w = load_workload(args.workload)
        rate = args.rate or float(w.defaults.get("rate", 1.0))
        duration = args.duration if args.duration is not None \
            else float(w.defaults.get("duration", 30))
        concurrency = args.concurrency or int(w.defaults.get("concurrency", 4))
        if concurrency < 1 or duration <= 0 or rate <= 0 or \
                (args.num_requests is not None and args.num_requests < 1):
            raise WorkloadError(
                "--concurrency, --duration, --rate and --num-requests must be > 0")
        plan = sessions(w, seed=args.seed, rate=rate, duration=duration,
                        max_sessions=args.num_requests, max_tokens=args.max_tokens)
    except WorkloadError as e:
        print(f"kvscope load: {e}", file=sys.stderr)
        return 2
    try:
        before = scrape(args.url, args.api_key)
    except httpx.HTTPError as e:
        print(f"kvscope load: cannot read {args.url}/metrics: {e}", file=sys.stderr)
        return 1
    bar = tqdm(total=args.num_requests, unit="req", desc=w.name, file=sys.stderr,
               disable=args.no_progress, dynamic_ncols=True)

    def on_done(rec, state) -> None:
        bar.update(1)
        bar.set_postfix(in_flight=state.in_flight,
                        failed=sum(not r.ok for r in state.records), refresh=False)

    t0 = time.perf_counter()
    state = RunState()
    interrupted = False
    try:
        asyncio.run(run_sessions(args.url, plan, concurrency=concurrency, duration=duration,
                                 max_requests=args.num_requests, model=args.model,
                                 api_key=args.api_key, max_wait_s=args.max_wait,
                                 on_done=on_done, state=state))
    except KeyboardInterrupt:  # Ctrl-C: still summarise what ran
        interrupted = True
    elapsed = time.perf_counter() - t0
    bar.close()
    if any(r.cancelled for r in state.records) or interrupted:
        _settle(args.url, args.api_key)
    after = scrape(args.url, args.api_key)
    summary = summarize(state.records, elapsed, before, after, w.name)
    print(json.dumps(summary, indent=2) if args.json else table(summary))
    if interrupted:
        return 130
    return 0 if summary["ok"] and summary["failed"] == 0 else 1


def _settle(url: str, api_key: str | None, timeout_s: float = 10.0) -> None:
    """After cancelling requests, give the server a moment to notice the closed
    connections and abort them (at its next step boundary), so the summary's server
    figures include those aborts."""
    import time

    from kvscope.engine.loadgen.summary import in_flight, scrape

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if in_flight(scrape(url, api_key)) == 0:  # kvscope's or vLLM's gauges
            return
        time.sleep(0.2)
