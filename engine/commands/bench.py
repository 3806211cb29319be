"""`kvscope bench NAME`: benchmarks that print measured numbers. Each lives in
``engine/bench/NAME.py`` and exposes ``register(subparsers)`` like a subcommand; the
package's other modules are what the benchmarks share (workloads, helpers)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil

from kvscope.engine import bench


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark and print measured numbers")
    bench_sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for info in sorted(pkgutil.iter_modules(bench.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):  # helpers of a benchmark, not benchmarks
            continue
        module = importlib.import_module(f"kvscope.engine.bench.{info.name}")
        if hasattr(module, "register"):
            module.register(bench_sub)
