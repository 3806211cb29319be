"""The native CPU decode attention (kernels/cpu_paged_decode.c) on a large decode batch at
SmolLM2's shapes (9 q / 3 kv heads of 64, pages of 16, shuffled): this tree against the
kernel of an earlier commit (`--before`, its kernels/ exported with `git archive`), each in
its own process, alternating rounds; per round the best and median of 40 calls. GB/s
counts the K and V bytes a call must read (the bound once the kernel is not instruction-
bound; two cores stream ~41 GB/s on the development machine). Prints the table; nothing is
asserted.

    .venv/bin/python scripts/bench_cpu_decode.py [--before REF] [--seqs 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from before_tree import export_tree

ROOT = Path(__file__).resolve().parents[1]
HQ, HKV, D, BS = 9, 3, 64, 16


def worker(kernels_root: str, seqs: int, threads: int) -> None:
    """Time the kernel of the kernels/ package under kernels_root; print JSON."""
    import torch

    sys.path.insert(0, kernels_root)
    from kvscope.kernels import cpu_native

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(150, 420, (seqs,), dtype=torch.int64, generator=g)
    pages = int((lens.max() + BS - 1) // BS)
    tables = torch.randperm(seqs * pages, generator=g).view(seqs, pages).contiguous()
    result = {"keys": int(lens.sum())}
    for dtype in (torch.float32, torch.bfloat16):
        kc = torch.randn(seqs * pages, BS, HKV, D, generator=g).to(dtype)
        vc = torch.randn(seqs * pages, BS, HKV, D, generator=g).to(dtype)
        q = torch.randn(seqs, HQ, D, generator=g).to(dtype)
        call = lambda: cpu_native.paged_decode(q, kc, vc, tables, lens, D ** -0.5,  # noqa: E731,B023
                                               out_dtype=dtype)  # noqa: B023
        call(), call()
        times = []
        for _ in range(40):
            t = time.perf_counter()
            call()
            times.append(time.perf_counter() - t)
        name = str(dtype).removeprefix("torch.")
        result[name] = {"min_ms": min(times) * 1e3, "median_ms": statistics.median(times) * 1e3,
                        "bytes": result["keys"] * HKV * D * 2 * kc.element_size()}
    print(json.dumps(result))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", help="git ref whose kernels/ to compare against")
    p.add_argument("--seqs", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.seqs, args.threads)
        return 0

    roots = {"this tree": str(ROOT)}
    tmp = tempfile.TemporaryDirectory(prefix="kvscope-decode-")
    if args.before:
        before = export_tree(args.before, Path(tmp.name) / "before", "kernels")
        roots = {f"before ({args.before})": str(before), **roots}
    runs: dict[str, list[dict]] = {name: [] for name in roots}
    for _ in range(args.rounds):
        for name, root in roots.items():
            out = subprocess.run([sys.executable, __file__, "--worker", root, "--seqs",
                                  str(args.seqs), "--threads", str(args.threads)],
                                 capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    keys = next(iter(runs.values()))[0]["keys"]
    print(f"{args.seqs} sequences, {keys} keys, {HQ} q / {HKV} kv heads of {D}, pages of "
          f"{BS}, {args.threads} threads; best of {args.rounds} rounds (each: min of 40 calls)")
    print("| kernel | dtype | ms (best) | medians per round | GB/s of K+V |")
    print("|---|---|---:|---|---:|")
    for name, rs in runs.items():
        for dtype in ("float32", "bfloat16"):
            best = min(r[dtype]["min_ms"] for r in rs)
            medians = " ".join(f"{r[dtype]['median_ms']:.2f}" for r in rs)
            gbs = rs[0][dtype]["bytes"] / best / 1e6
            print(f"| {name} | {dtype} | {best:.2f} | {medians} | {gbs:.1f} |")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
