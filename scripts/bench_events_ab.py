"""The event stream end to end, this tree against another revision, side by side in one
run: ``python scripts/bench_events_ab.py REV [--steps N] [--rounds R]``.

REV's ``engine/`` and ``assets/`` are exported with ``git archive`` into a temporary
directory and loaded as the package ``kvscope`` (scripts/checkout.py; REV must have that
package, i.e. be at or after the commit that introduced it); both trees publish the same
pre-generated batches (bench_events.py's two mixes) to a subscriber in another process,
alternating, best of R."""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

from bench_events import REPO, bench_throughput


def export_tree(rev: str, into: Path) -> Path:
    root = into / rev.replace("/", "_")
    root.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "engine", "assets"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the other revision (a commit, tag or branch)")
    ap.add_argument("--steps", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        roots = {"this tree": REPO, args.rev: export_tree(args.rev, Path(d))}
        print(json.dumps(bench_throughput(args.steps, args.rounds, roots), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
