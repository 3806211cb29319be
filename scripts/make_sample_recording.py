"""Write assets/sample.kvtrace: the small recording `kvscope inspect` opens by default.

    .venv/bin/python scripts/make_sample_recording.py [--out PATH] [--steps N] [--seed S]

Drives a seeded workload through an event source and records every step with
engine.events' RecordingWriter. Same seed, same file content (except the header's
creation time).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.events import PROTOCOL_VERSION, KVState, ListSink  # noqa: E402
from engine.events.recording import RecordingWriter  # noqa: E402
from engine.events.synthetic import SyntheticCache  # noqa: E402

T0 = 1_763_800_000.0  # fixed start time: the file does not depend on when it was made


def synthetic_steps(steps: int, seed: int) -> Any:
    """(batch, state) per step from engine.events' SyntheticCache (no engine needed)."""
    cache = SyntheticCache(seed=seed, gpu_blocks=1536, cpu_blocks=512, block_size=16,
                           max_running=24, arrival_rate=0.9)
    sink, state = ListSink(), KVState()
    for step in range(steps):
        stats = cache.step(sink)
        events = sink.drain()
        hit = sum(int(e.get("tokens", 0)) for e in events if e["kind"] in ("hit", "host_hit"))
        stats.setdefault("hit_tokens", hit)
        batch = {"v": PROTOCOL_VERSION, "epoch": "sample", "seq": step, "step": step,
                 "time": T0 + 0.05 * step, "events": events, "stats": stats}
        state.apply(batch)
        yield batch, state


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "assets" / "sample.kvtrace"))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args(argv)
    t = time.perf_counter()
    header = {"engine": {"workload": "synthetic", "seed": args.seed}, "model": None,
              "source": "scripts/make_sample_recording.py"}
    with RecordingWriter(args.out, header, keyframe_every_steps=100,
                         keyframe_every_s=1e9) as w:
        for batch, state in synthetic_steps(args.steps, args.seed):
            w.add(batch, state)
    size = Path(args.out).stat().st_size
    print(f"wrote {args.out}: {args.steps} steps, {size / 1024:.0f} KiB "
          f"in {time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
