"""Everything the GPU device window checks and measures (issue 33), planned to fit one
15-minute window: run 1 (at most 420 s of work, under a 480 s limit) answers what matters
first; run 2 (at most 240 s) only when time is left (docs/GPU.md is the recipe).

    python scripts/gpu_check.py --list              # the plan: sections, budgets, runs
    python scripts/gpu_check.py OUT_DIR --run 1     # on the device (run 2 likewise)
    python scripts/gpu_check.py OUT_DIR --section NAME   # one section, in this process
    python scripts/gpu_check.py OUT_DIR --smoke     # every section, tiny shapes, on CPU

A run starts each section in its own process and kills it at its budget, so a CUDA error,
a leak or a hang stays in its section and the run always ends inside its limit. Each
section writes OUT_DIR/<section>.json as soon as it ends (a killed run keeps what
finished); the run writes OUT_DIR/run<N>.md (the table, with GPU, versions and date,
rewritten after every section) and OUT_DIR/run<N>.log (every section's whole output), and
prints the table last. At most 8 files: what the device tool brings back.

A section's status: ok, miss (measured; a goal of the issue missed), fail (a correctness
check failed), timeout (killed at its budget), error (it raised: the traceback is in its
JSON and the log). The exit code is 1 when any section failed, timed out or raised.
"""

from __future__ import annotations

import os
import sys

SMOKE = "--smoke" in sys.argv
if SMOKE:  # the Triton interpreter must be on before triton or kernels is imported
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def _importable_checkout() -> None:
    """On the device the checkout is not pip-installed: build the package ``kvscope`` from
    it (scripts/checkout.py) and put it on this process's and the children's path."""
    paths: list[str] = []
    if importlib.util.find_spec("kvscope") is None:
        from checkout import importable

        paths.append(importable(ROOT))
        sys.path.insert(0, paths[0])
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])


@dataclass(frozen=True)
class Section:
    name: str
    run: int  # which device call runs it: 1 (always), 2 (when the window has time left)
    budget_s: int  # wall seconds, process start included; killed there
    answers: str


# In run order. Run 1 holds what must come back from the first window (correctness, then
# the numbers the goals name); run 2 what can wait for time left or the next one.
# Budgets include the section's process start (torch import, ~3 s there). kernels is the
# widest: some 50 Triton compilations (page formats x kernels x specialisations) before
# its tests run, none cached on a fresh machine.
PLAN = (
    Section("device", 1, 20, "GPU, versions, copy bandwidth, pinned H2D/D2H, bf16 matmul"),
    Section("kernels", 1, 110, "Triton on sm_90: every page format, block sizes 1/16/128, "
                              "split-K decode, prefill with cached context"),
    Section("invariance", 1, 90, "engine on CUDA, dummy SmolLM2: greedy tokens equal across "
                                 "block size, prefix caching, CoW, preemption, chunking; "
                                 "CUDA graphs = eager"),
    Section("decode", 1, 80, "8B decode step at batch 1/8/64/256, ctx 2k, graphs and eager, "
                             "vs its floor; host syncs per step"),
    Section("attention", 1, 60, "paged decode attention vs copy bandwidth and SDPA: batch "
                                "32/128, ctx 4k/16k, bf16 and int8 pages"),
    Section("events", 1, 30, "events + recording on vs off on the 8B engine; events/s"),
    Section("offline", 2, 110, "8B offline throughput vs HF generate (static cache)"),
    Section("capacity", 2, 50, "kvscope bench capacity at 8B shapes"),
    Section("swap", 2, 40, "kvscope bench swap at 8B shapes"),
    Section("quant", 2, 40, "quantized pages' greedy agreement; fp32 paged = contiguous"),
)
RUN_LIMITS_S = {1: 420, 2: 240}  # of work; the device call's own limit: run 1 under 480 s
SECTIONS = {s.name: s for s in PLAN}
SMOKE_BUDGET_S = 300  # per section on CPU: a hang guard, not a plan
WIND_DOWN_S = 8  # a section's loops stop this long before its kill (a row, the JSON write)
KILL_AT = "GPU_CHECK_KILL_AT"  # env: when the run kills this section (time.time() seconds)
MAX_FILES = 8  # what the device tool brings back from $OUT


def budget_s(section: Section, smoke: bool) -> int:
    return SMOKE_BUDGET_S if smoke else section.budget_s


# ---------------------------------------------------------------- one section (a child)
def run_section(out_dir: Path, name: str, smoke: bool) -> dict:
    """Run one section in this process and write OUT_DIR/<name>.json: its result, status,
    seconds and who measured. An exception is recorded with its traceback."""
    import gpu_sections
    import torch

    started = time.perf_counter()
    budget = budget_s(SECTIONS[name], smoke)
    # started by a run: its kill time (this process's start counts against the budget);
    # by hand: the budget from now
    kill_at = float(os.environ.get(KILL_AT, time.time() + budget))
    startup_s = time.time() - (kill_at - budget)
    device = torch.device("cpu" if smoke else "cuda")
    if smoke:
        torch.set_num_threads(1)
    who = gpu_sections.meta(device)  # before the section: a CUDA error can leave none after
    ctx = gpu_sections.Context(out_dir, smoke, device, deadline=started + kill_at - time.time()
                               - min(WIND_DOWN_S, budget / 4))
    try:
        result = gpu_sections.RUNNERS[name](ctx)
        result.setdefault("status", "ok")
    except Exception as e:  # noqa: BLE001  (recorded; the run goes on with the next section)
        traceback.print_exc()
        result = {"status": "error", "error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc(), "summary": f"{type(e).__name__}: {e}"}
    if result["status"] == "ok" and result.get("goal_met") is False:
        result["status"] = "miss"  # ran and measured, a performance goal missed
    result |= {"section": name, "run": SECTIONS[name].run, "budget_s": budget,
               "seconds": round(time.perf_counter() - started, 1),
               "startup_s": round(startup_s, 1),
               "meta": who, "smoke": smoke}
    write_json(out_dir / f"{name}.json", result)
    return result


def write_json(path: Path, obj: Any) -> None:
    """Whole or not at all (a kill mid-write leaves the previous file or none)."""
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


# ---------------------------------------------------------------- the run (the driver)
def child_command(out_dir: Path, name: str, smoke: bool) -> list[str]:
    return [sys.executable, str(SCRIPT), str(out_dir), "--section", name,
            *(["--smoke"] if smoke else [])]


def launch(out_dir: Path, section: Section, smoke: bool, log: Path,
           command: Callable[[Path, str, bool], list[str]]) -> dict:
    """One section in its own process (and process group, so a pytest it started dies with
    it; not its own session, which would outlive the device call were the run killed), its
    output appended to ``log``, killed at the budget. Its JSON, or what the run saw when it
    wrote none."""
    path = out_dir / f"{section.name}.json"
    path.unlink(missing_ok=True)  # a stale file from an earlier run must not pass for this one
    budget = budget_s(section, smoke)
    t0 = time.perf_counter()
    with log.open("a") as sink:
        sink.write(f"\n===== {section.name} (budget {budget} s) =====\n")
        sink.flush()
        proc = subprocess.Popen(command(out_dir, section.name, smoke), cwd=ROOT,
                                stdout=sink, stderr=subprocess.STDOUT, process_group=0,
                                env={**os.environ, "PYTHONUNBUFFERED": "1",
                                     KILL_AT: str(time.time() + budget)})
        try:
            rc = proc.wait(timeout=budget)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    path.with_suffix(".json.tmp").unlink(missing_ok=True)  # a write the kill cut short
    wall = round(time.perf_counter() - t0, 1)
    if path.is_file():
        result = json.loads(path.read_text())
    else:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        why = (f"killed at its {budget} s budget" if rc is None else f"exited {rc} without "
               "writing its result")
        result = {"status": "timeout" if rc is None else "error", "section": section.name,
                  "run": section.run, "budget_s": budget, "seconds": wall,
                  "summary": f"{why}; log tail: {' | '.join(tail)[-300:]}", "log_tail": tail}
        write_json(path, result)
    result["wall_s"] = wall
    return result


def run_plan(out_dir: Path, sections: list[Section], smoke: bool, stem: str,
             command: Callable[[Path, str, bool], list[str]] = child_command) -> int:
    out_dir.mkdir(parents=True, exist_ok=True)
    log, md = out_dir / f"{stem}.log", out_dir / f"{stem}.md"
    log.write_text(f"scripts/gpu_check.py {' '.join(sys.argv[1:])}\n")
    results: dict[str, dict] = {}
    for section in sections:
        print(f"[gpu_check] {section.name} (run {section.run}, budget "
              f"{budget_s(section, smoke)} s) ...", flush=True)
        result = launch(out_dir, section, smoke, log, command)
        results[section.name] = result
        md.write_text(markdown(results, stem))
        print(f"[gpu_check] {section.name}: {result['status']} in {result['wall_s']} s: "
              f"{result.get('summary', '')}", flush=True)
    print()
    print(table(results))
    print(f"\nresults: {out_dir}/<section>.json, {md.name} (the table for "
          f"docs/BENCHMARKS.md), {log.name} (all output)")
    bad = [n for n, r in results.items() if r["status"] in ("error", "fail", "timeout")]
    return 1 if bad else 0


def table(results: dict[str, dict]) -> str:
    lines = [f"{'section':<11} {'status':<7} {'s':>6}  result",
             f"{'-' * 11} {'-' * 7} {'-' * 6}  {'-' * 50}"]
    for name, r in results.items():
        summary = str(r.get("summary", ""))[:200].replace("\n", " ")
        lines.append(f"{name:<11} {r['status']:<7} {r['wall_s']:>6.1f}  {summary}")
    return "\n".join(lines)


def markdown(results: dict[str, dict], stem: str) -> str:
    """The table as markdown, with the machine and date, ready for docs/BENCHMARKS.md."""
    m = next((r["meta"] for r in results.values() if "meta" in r), {})
    head = (f"{m.get('gpu', m.get('device', '?'))}, torch {m.get('torch', '?')}, triton "
            f"{m.get('triton', '?')}, {m.get('date', '?')}") if m else "no section finished"
    lines = [f"{head} (`scripts/gpu_check.py` {stem})", "",
             "| section | status | seconds | result |", "|---|---|---|---|"]
    for name, r in results.items():
        summary = str(r.get("summary", "")).replace("|", "/").replace("\n", " ")
        lines.append(f"| {name} | {r['status']} | {r['wall_s']} | {summary} |")
    return "\n".join(lines) + "\n"


def plan_text() -> str:
    lines = [f"{'run':<4} {'section':<11} {'budget':>7}  answers"]
    for s in PLAN:
        lines.append(f"{s.run:<4} {s.name:<11} {s.budget_s:>5} s  {s.answers}")
    for run, limit in RUN_LIMITS_S.items():
        total = sum(s.budget_s for s in PLAN if s.run == run)
        lines.append(f"run {run}: {total} s of work at most (limit {limit} s)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", nargs="?", type=Path)
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--run", type=int, choices=sorted(RUN_LIMITS_S),
                       help="the sections of device call N (docs/GPU.md)")
    which.add_argument("--section", choices=list(SECTIONS),
                       help="one section, in this process (what a run starts per section)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes on CPU (Triton interpreter); without --run/--section, "
                         "every section")
    ap.add_argument("--list", action="store_true", help="print the plan")
    args = ap.parse_args(argv)
    if args.list:
        print(plan_text())
        return 0
    if args.out_dir is None:
        ap.error("OUT_DIR is required")
    if args.run is None and args.section is None and not args.smoke:
        ap.error("choose --run 1, --run 2, --section NAME or --smoke")
    if not args.smoke:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check.py: no CUDA device here; use --smoke for the CPU code-path check",
                  file=sys.stderr)
            return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.section:
        result = run_section(args.out_dir, args.section, args.smoke)
        print(f"[gpu_check] {args.section}: {result['status']} in {result['seconds']} s: "
              f"{result.get('summary', '')}")
        return 1 if result["status"] in ("error", "fail", "timeout") else 0
    sections = [s for s in PLAN if args.run is None or s.run == args.run]
    stem = f"run{args.run}" if args.run else "smoke"
    return run_plan(args.out_dir, sections, args.smoke, stem)


if __name__ == "__main__":
    # Only as a program: imported (the tests), it must not change the importer's environment
    _importable_checkout()
    sys.exit(main())
