"""Where kvscope's served latency goes: the issue-22 served workload, traced, before/after.

    .venv/bin/python scripts/profile_served.py [--before REV] [--variant LABEL=FLAGS ...]
        [--passes 2] [--requests 32] [--concurrency 4] [--dtype float32] [--threads 2]
        [--json-out PATH]

Starts ``kvscope serve`` (the command line of scripts/bench_vs_vllm.py's served run) from
this tree ("after"), with ``--before REV`` from a ``git archive`` of REV ("before"), and
with ``--variant LABEL=FLAGS`` from this tree with extra serve flags, all with a tracer
installed (this file, ``server`` mode, wraps the engine's and the daemon's functions: the
product code has no profiling hooks). The servers stay up; a streaming client drives them
in turn, pass by pass, with fresh prompts each pass (the same for all): 32 token-id
prompts of 286 tokens x 64 tokens, greedy, ignore_eos, concurrency 4.
Before each pass an offline engine (no daemon, this tree) runs decode steps of the
same batch, so the served step can be compared with the model's own step at the same
moment of a shared box.

The table splits the served inter-token latency (ITL, client side, as bench_vs_vllm's
``drive`` computes it) into what the engine thread does between two deliveries (the step:
schedule, forward, sample/detokenize, build outputs, close the step's events; the loop:
deliveries, metrics, commands; idle waiting) and what happens after (engine thread ->
asyncio queue hop, then SSE encode, socket and client parse). All clocks are
CLOCK_MONOTONIC (``time.perf_counter``), shared by the processes on one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import bench_vs_vllm as bench  # noqa: E402  (sibling script: prompts, server command line)
from before_tree import export_tree  # noqa: E402

OFFLINE_STEPS = 24  # decode steps of the offline reference batch


# ---------------------------------------------------------------- tracer (server side)

class Tracer:
    """Timestamps from inside the daemon, appended on the thread that does the work.

    Records: ("step", t0, t1, schedule, forward, process, close, prefill_tokens, decodes)
    for every LLMEngine.step (outputs = t1 - t0 - the rest); ("loop", t0, t1) for every
    EngineLoop step (the engine step plus deliveries and metrics); ("deliver", t, rid, n)
    on the engine thread and ("take", t, rid, n) on the asyncio thread for each output
    (n = tokens so far)."""

    def __init__(self) -> None:
        self.records: list[tuple] = []
        self.parts: dict[str, float] = {}

    def timed(self, name: str, fn: Any) -> Any:
        parts = self.parts

        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                parts[name] = parts.get(name, 0.0) + time.perf_counter() - t
        return wrapper

    def install(self) -> None:
        from kvscope.engine import engine as engine_mod
        from kvscope.engine import scheduler as scheduler_mod
        from kvscope.engine.runner import model_runner as runner_mod
        from kvscope.engine.server import engine_loop as loop_mod
        from kvscope.engine.server import jobs as jobs_mod

        rec = self.records.append
        E = engine_mod.LLMEngine
        for cls, attr, name in ((scheduler_mod.Scheduler, "schedule", "schedule"),
                                (runner_mod.ModelRunner, "execute_keeping", "forward"),
                                (E, "_process", "process"), (E, "_close_step", "close")):
            if hasattr(cls, attr):  # a renamed part reads 0 ms rather than breaking the run
                setattr(cls, attr, self.timed(name, getattr(cls, attr)))
        step, parts = E.step, self.parts

        def traced_step(engine: Any) -> Any:
            parts.clear()
            t0 = time.perf_counter()
            out = step(engine)
            s = engine.stats  # a StepStats; a plain map in trees before it
            s = s.to_map() if hasattr(s, "to_map") else s
            rec(("step", t0, time.perf_counter(), parts.get("schedule", 0.0),
                 parts.get("forward", 0.0), parts.get("process", 0.0), parts.get("close", 0.0),
                 s.get("prefill_tokens", 0), s.get("decode_tokens", 0)))
            return out
        E.step = traced_step

        L = loop_mod.EngineLoop
        loop_step, submit = L._step, L.submit

        def traced_loop_step(self_: Any) -> None:
            t0 = time.perf_counter()
            loop_step(self_)
            rec(("loop", t0, time.perf_counter()))
        L._step = traced_loop_step

        def traced_submit(self_: Any, rid: str, prompt: Any, params: Any, deliver: Any) -> Any:
            def traced_deliver(item: Any) -> None:
                rec(("deliver", time.perf_counter(), rid, _ntokens(item)))
                deliver(item)
            return submit(self_, rid, prompt, params, traced_deliver)
        L.submit = traced_submit

        take = jobs_mod.take

        def traced_take(job: Any, item: Any) -> Any:
            rec(("take", time.perf_counter(), getattr(item, "request_id", ""), _ntokens(item)))
            return take(job, item)
        jobs_mod.take = traced_take


def _ntokens(item: Any) -> int:
    outs = getattr(item, "outputs", None)
    return len(outs[0].token_ids) if outs else -1


def server_main(args: argparse.Namespace, serve_args: list[str]) -> int:
    """The daemon with the tracer installed; the trace is written when it stops."""
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, args.root)
    tracer = Tracer()
    tracer.install()
    from kvscope.engine.cli import main

    try:
        return main(["serve", *serve_args])
    finally:
        Path(args.trace).write_text(json.dumps(tracer.records))


def offline_main(args: argparse.Namespace) -> int:
    """Decode steps of `concurrency` sequences in a bare engine: the model's own step."""
    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, args.root)
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.engine import LLMEngine
    from kvscope.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model="smollm2", device="cpu", dtype=args.dtype,
                                    max_model_len=bench.MAX_MODEL_LEN))
    prompts = json.loads(Path(args.prompts).read_text())
    for i, ids in enumerate(prompts):
        engine.add_request(f"o{i}", ids, SamplingParams(max_tokens=OFFLINE_STEPS + 1,
                                                        temperature=0, ignore_eos=True))
    times = []
    engine.step()  # the prefill
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    print(json.dumps({"decode_step_s": times}))
    return 0


# ---------------------------------------------------------------- client

async def drive(url: str, prompts: list[list[int]], max_tokens: int,
                concurrency: int) -> dict[str, Any]:
    """bench_vs_vllm.drive's workload and TTFT/ITL rule, keeping every timestamp."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    reqs: list[dict[str, Any]] = []

    async def one(client: httpx.AsyncClient, ids: list[int]) -> None:
        body = {"model": "smollm2", "prompt": ids, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        async with sem:
            r: dict[str, Any] = {"t0": time.perf_counter(), "recv": [], "id": None}
            async with client.stream("POST", url + "/v1/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    r["id"] = chunk.get("id", r["id"])
                    choices = chunk.get("choices")
                    if choices and choices[0].get("text"):
                        r["recv"].append(time.perf_counter())
            reqs.append(r)

    async with httpx.AsyncClient(timeout=600) as client:
        t = time.perf_counter()
        await asyncio.gather(*(one(client, ids) for ids in prompts))
        t1 = time.perf_counter()
    return {"t0": t, "t1": t1, "requests": reqs}


# ---------------------------------------------------------------- analysis

def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def analyse(run: dict[str, Any], trace: list[list], offline: list[float]) -> dict[str, float]:
    """One pass: the client's numbers and the server's breakdown, in ms."""
    t0, t1 = run["t0"], run["t1"]
    inside = [r for r in trace if t0 <= r[1] <= t1]
    steps = [r for r in inside if r[0] == "step"]
    loops = [r for r in inside if r[0] == "loop"]
    ttft, itl = [], []
    for r in run["requests"]:
        if r["recv"]:
            ttft.append(r["recv"][0] - r["t0"])
            itl += [b - a for a, b in zip(r["recv"], r["recv"][1:], strict=False)]
    decode_only = [s for s in steps if s[7] == 0 and s[8] > 0]
    mixed = [s for s in steps if s[7] > 0 and s[8] > 0]
    prefill_only = [s for s in steps if s[7] > 0 and s[8] == 0]
    batch = max((s[8] for s in decode_only), default=0)
    full = [s for s in decode_only if s[8] == batch]

    # deliver (engine thread) -> take (asyncio) of the same output
    delivered: dict[tuple[str, int], float] = {}
    hop = []
    for r in inside:
        if r[0] == "deliver":
            delivered[(r[2], r[3])] = r[1]
        elif r[0] == "take" and (r[2], r[3]) in delivered:
            hop.append(r[1] - delivered[(r[2], r[3])])
    # take -> client receive, per token: match by response id (rid = id + "-0")
    takes: dict[str, list[float]] = defaultdict(list)
    for r in inside:
        if r[0] == "take" and r[3] > 0:
            takes[r[2]].append(r[1])
    wire = []
    for r in run["requests"]:
        ts = takes.get(f"{r['id']}-0", [])
        wire += [b - a for a, b in zip(ts, r["recv"], strict=False)]
    busy = sum(s[2] - s[1] for s in steps)
    loop_busy = sum(lp[2] - lp[1] for lp in loops)
    ends = sorted(lp[2] for lp in loops)
    wall = t1 - t0
    ms = 1e3
    return {
        "req_per_s": len(run["requests"]) / wall,
        "ttft_p50_ms": p50(ttft) * ms, "itl_p50_ms": p50(itl) * ms,
        "itl_p99_ms": bench.percentile(itl, 99) * ms if itl else float("nan"),
        "steps": len(steps), "mixed_steps": len(mixed), "prefill_only_steps": len(prefill_only),
        "decode_batch": batch,
        "step_interval_p50_ms": p50([b - a for a, b in zip(ends, ends[1:], strict=False)]) * ms,
        "decode_step_p50_ms": p50([s[2] - s[1] for s in full]) * ms,
        "schedule_p50_ms": p50([s[3] for s in full]) * ms,
        "forward_p50_ms": p50([s[4] for s in full]) * ms,
        "process_p50_ms": p50([s[5] for s in full]) * ms,
        "close_p50_ms": p50([s[6] for s in full]) * ms,
        "outputs_p50_ms": p50([s[2] - s[1] - s[3] - s[4] - s[5] - s[6] for s in full]) * ms,
        "loop_overhead_p50_ms": p50(_loop_overheads(loops, steps)) * ms,
        "mixed_step_p50_ms": p50([s[2] - s[1] for s in mixed]) * ms,
        "engine_busy_share": busy / wall, "loop_busy_share": loop_busy / wall,
        "hop_p50_ms": p50(hop) * ms, "wire_p50_ms": p50(wire) * ms,
        "offline_decode_step_p50_ms": p50(offline) * ms,
    }


def _loop_overheads(loops: list[list], steps: list[list]) -> list[float]:
    """Per EngineLoop step: its time outside the engine step it ran (deliveries, metrics)."""
    out, i = [], 0
    steps = sorted(steps, key=lambda s: s[1])
    for lp in sorted(loops, key=lambda r: r[1]):
        while i < len(steps) and steps[i][1] < lp[1]:
            i += 1
        if i < len(steps) and steps[i][2] <= lp[2]:
            out.append((lp[2] - lp[1]) - (steps[i][2] - steps[i][1]))
    return out


ROWS = [  # (key, label)
    ("req_per_s", "requests/s (client)"),
    ("ttft_p50_ms", "TTFT p50 ms (client)"),
    ("itl_p50_ms", "ITL p50 ms (client)"),
    ("itl_p99_ms", "ITL p99 ms (client)"),
    ("step_interval_p50_ms", "engine loop: step end -> next step end p50 ms"),
    ("decode_step_p50_ms", "decode step (full batch) p50 ms"),
    ("forward_p50_ms", "  forward (runner) p50 ms"),
    ("schedule_p50_ms", "  schedule p50 ms"),
    ("process_p50_ms", "  sample + detokenize p50 ms"),
    ("outputs_p50_ms", "  build outputs p50 ms"),
    ("close_p50_ms", "  close step (stats, events) p50 ms"),
    ("loop_overhead_p50_ms", "loop: deliveries + metrics p50 ms"),
    ("offline_decode_step_p50_ms", "offline decode step, same batch, p50 ms"),
    ("hop_p50_ms", "engine thread -> asyncio queue hop p50 ms"),
    ("wire_p50_ms", "asyncio take -> client receive p50 ms"),
    ("engine_busy_share", "engine stepping, share of wall"),
    ("decode_batch", "decode batch (most sequences in a step)"),
    ("steps", "steps"),
    ("mixed_steps", "steps mixing prefill and decodes"),
    ("prefill_only_steps", "prefill-only steps"),
    ("mixed_step_p50_ms", "mixed step p50 ms"),
]


def format_table(per: dict[str, list[dict[str, float]]]) -> str:
    names = list(per)
    out = ["| metric | " + " | ".join(f"{n} (median of passes) | {n} passes" for n in names)
           + " |", "|---" * (1 + 2 * len(names)) + "|"]
    for key, label in ROWS:
        cells = []
        for n in names:
            vals = [p[key] for p in per[n]]
            cells += [_num(statistics.median(vals)), " ".join(_num(v) for v in vals)]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def _num(x: float) -> str:
    if x != x:
        return "-"
    if float(x).is_integer() and abs(x) >= 1:
        return str(int(x))
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}"


# ---------------------------------------------------------------- parent

@functools.cache
def _tokenizer() -> Any:
    from kvscope.engine.model import load_model

    return load_model("smollm2")[1]


def served_prompts(seed: int, n: int) -> list[list[int]]:
    """bench_vs_vllm's served prompts (n passages, each cut to 286 tokens), tokenized with
    the engine's own tokenizer (the same vocabulary as the HF copy the bench uses)."""
    want = bench.SERVED["served"]["prompt_tokens"]
    tok = _tokenizer()
    texts = [" ".join(p.split() * 40) for p in bench.make_prompts(n, seed + 2)]
    return [tok.encode(t, add_special_tokens=False)[:want] for t in texts]


@contextlib.contextmanager
def traced_server(name: str, root: Path, args: argparse.Namespace, workdir: Path,
                  flags: list[str], extra_env: dict[str, str]):
    port = bench.free_port()
    url = f"http://127.0.0.1:{port}"
    trace = workdir / f"{name}.trace.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "server", "--root", str(root),
           "--trace", str(trace), "--threads", str(args.threads), "--",
           "--model", "smollm2", "--device", "cpu", "--host", "127.0.0.1", "--port",
           str(port), "--dtype", args.dtype, "--max-model-len", str(bench.MAX_MODEL_LEN),
           "--served-model-name", "smollm2", *flags]
    env = {**bench.engine_env(bench.Engine("kvscope", sys.executable, "smollm2"), args.threads),
           "PYTHONPATH": str(root), **extra_env}
    holder: dict[str, Any] = {}
    with bench.process_group(cmd, workdir / f"{name}.log", env, stdout=subprocess.DEVNULL,
                             cwd=root) as proc:
        bench.wait_healthy(url, proc, 300)
        asyncio.run(drive(url, [[1, 2, 3, 4]] * 2, 4, 2))  # warm-up
        holder["url"] = url
        yield holder
    holder["trace"] = json.loads(trace.read_text()) if trace.exists() else []


def offline_steps(root: Path, prompts: list[list[int]], args: argparse.Namespace,
                  workdir: Path) -> list[float]:
    path = workdir / "offline-prompts.json"
    path.write_text(json.dumps(prompts))
    cmd = [sys.executable, str(Path(__file__).resolve()), "offline", "--root", str(root),
           "--prompts", str(path), "--threads", str(args.threads), "--dtype", args.dtype]
    env = {**bench.engine_env(bench.Engine("kvscope", sys.executable, "smollm2"), args.threads),
           "PYTHONPATH": str(root)}
    done = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True,
                          timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["decode_step_s"]


def run(args: argparse.Namespace) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="kvscope-profile-served-"))
    # column -> (tree, extra serve flags, extra environment)
    trees: dict[str, tuple[Path, list[str], dict[str, str]]] = {}
    if args.before:
        before = workdir / "before"
        export_tree(args.before, before)
        trees[f"before ({args.before})"] = (before, [], {})
    trees["after"] = (ROOT, [], {})
    for variant in args.variant:
        label, _, flags = variant.partition("=")
        words = flags.split()
        env = {}  # leading NAME=value words set the server's environment, as in a shell
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        trees[f"after {label}"] = (ROOT, words, env)
    print(f"machine: {bench.cpu_model()}, {os.cpu_count()} CPUs; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", flush=True)
    runs: dict[str, list[tuple[dict, list[float]]]] = {n: [] for n in trees}
    loads = [bench.load_average()]
    with contextlib.ExitStack() as stack:
        servers = {n: stack.enter_context(traced_server(f"s{i}", root, args, workdir, flags,
                                                        env))
                   for i, (n, (root, flags, env)) in enumerate(trees.items())}
        for p in range(args.passes):
            prompts = served_prompts(args.seed + 1000 * (p + 1), args.requests)
            # the model's own step, once a pass (the engine code is the same in every column)
            off = offline_steps(ROOT, prompts[:args.concurrency], args, workdir)
            for n in trees:
                r = asyncio.run(drive(servers[n]["url"], prompts,
                                      bench.SERVED["served"]["max_tokens"],
                                      args.concurrency))
                runs[n].append((r, off))
                wall = r["t1"] - r["t0"]
                print(f"pass {p + 1}/{args.passes} {n}: {len(prompts) / wall:.2f} req/s "
                      f"(load {bench.load_average()})", flush=True)
                loads.append(bench.load_average())
    per = {n: [analyse(r, servers[n]["trace"], off) for r, off in runs[n]] for n in trees}
    print(f"load average (1/5/15 min) before and after each pass: {' | '.join(loads)}")
    print(format_table(per))
    Path(args.json_out).write_text(json.dumps({"passes": per, "load_average": loads},
                                              indent=2))
    print(f"wrote {args.json_out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode")
    for mode in ("server", "offline"):
        s = sub.add_parser(mode, help=f"internal: the traced {mode} process")
        s.add_argument("--root", required=True)
        s.add_argument("--threads", type=int, default=2)
        if mode == "server":
            s.add_argument("--trace", required=True)
        else:
            s.add_argument("--prompts", required=True)
            s.add_argument("--dtype", default="float32")
    p.add_argument("--before", default=None, metavar="REV",
                   help="also run a git archive of REV, alternating with this tree")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=FLAGS",
                   help="also serve this tree with these extra `kvscope serve` flags, e.g. "
                        "'p0=--max-prefill-tokens-with-decodes 0'; leading NAME=value words "
                        "set the server's environment (repeatable)")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--requests", type=int, default=bench.SERVED["served"]["requests"])
    p.add_argument("--concurrency", type=int, default=bench.SERVED["served"]["concurrency"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default="profile_served.json")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    serve_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_args = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    if args.mode == "server":
        return server_main(args, serve_args)
    if args.mode == "offline":
        return offline_main(args)
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
