"""Lifecycle benchmarks (offscreen): building the LifecycleIndex over a stream of batches,
and scrolling the lifecycle Gantt with 10k+ sequences.

    QT_QPA_PLATFORM=offscreen .venv/bin/python scripts/bench_lifecycle.py
        [--seqs 10000] [--frames 300] [--recording-steps 36000]

``--recording-steps N`` also times reading and indexing a recording of N steps of the
inspector seek benchmark's synthetic workload (8192+2048 blocks, 10 steps/s).

The workload: ``--seqs`` sequences arriving 8 per step, each waiting 2 steps, prefilling
in 2 chunks, decoding 40 tokens; every 7th is preempted once (recompute) and re-prefills.
A scroll frame is what a wheel turn does: move the first row by 3 and repaint the canvas
synchronously (``repaint``); a page frame jumps by a page. Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvscope.engine.events import PROTOCOL_VERSION  # noqa: E402
from kvscope.engine.events.analysis.lifecycle import LifecycleIndex  # noqa: E402


def workload(num_seqs: int, per_step: int = 8) -> list[dict]:
    """Batches (protocol form) of the benchmark workload; block ids are plausible, not
    checked (the index does not track ref counts)."""
    by_step: dict[int, list[dict]] = {}
    tokens: dict[int, dict[str, int]] = {}

    def at(step: int, ev: dict) -> None:
        by_step.setdefault(step, []).append(ev)

    for i in range(num_seqs):
        sid, t = f"req-{i:06d}-{i * 7919 % 100000:05d}", i // per_step
        at(t, {"kind": "seq_add", "seq": sid, "prompt_tokens": 96})
        start = t + 2
        at(start, {"kind": "seq_start", "seq": sid})
        at(start, {"kind": "alloc", "tier": "gpu", "seq": sid, "blocks": [i % 4096] * 6})
        tokens.setdefault(start, {})[sid] = 48
        tokens.setdefault(start + 1, {})[sid] = 96
        s = start + 2
        n = 96
        if i % 7 == 0:  # preempted once, then recomputes its prompt
            at(s + 5, {"kind": "free", "tier": "gpu", "seq": sid, "blocks": [i % 4096] * 6})
            at(s + 5, {"kind": "seq_preempt", "seq": sid, "mode": "recompute",
                       "cause": {"needed_by": "x", "blocks_needed": 1, "free_blocks": 0,
                                 "policy": "lowest priority", "reason": "allocate"}})
            tokens.setdefault(s + 5, {})[sid] = 0
            at(s + 8, {"kind": "seq_resume", "seq": sid})
            tokens.setdefault(s + 8, {})[sid] = 96
            for k in range(5):
                tokens.setdefault(s + k, {})[sid] = 97 + k
            s, n = s + 9, 96
        for k in range(40):
            tokens.setdefault(s + k, {})[sid] = n + 1 + k
        at(s + 40, {"kind": "free", "tier": "gpu", "seq": sid, "blocks": [i % 4096] * 9})
        at(s + 40, {"kind": "seq_finish", "seq": sid, "reason": "length", "num_tokens": n + 40,
                    "output_tokens": 41})
    batches = [{"v": PROTOCOL_VERSION, "step": 0, "time": 0.0, "events": [
        {"kind": "tier_init", "tier": "gpu", "num_blocks": 4096, "block_size": 16},
        *by_step.get(0, [])], "stats": {}}]
    last = max(max(by_step), max(tokens))
    for step in range(1, last + 1):
        evs = list(by_step.get(step, []))
        tok = tokens.get(step)
        if tok:
            evs.append({"kind": "seq_tokens", "seqs": list(tok), "num_tokens": list(tok.values())})
        batches.append({"v": PROTOCOL_VERSION, "step": step, "time": step * 0.05,
                        "events": evs, "stats": {"step_time_s": 0.05}})
    return batches


def bench_index(batches: list[dict]) -> LifecycleIndex:
    n_events = sum(len(b["events"]) for b in batches)
    t0 = time.perf_counter()
    idx = LifecycleIndex.from_batches(batches)
    dt = time.perf_counter() - t0
    print(f"index: {len(batches):,} steps, {n_events:,} events, {len(idx.seqs):,} sequences "
          f"in {dt:.2f} s ({len(batches) / dt:,.0f} steps/s, {n_events / dt:,.0f} events/s)")
    return idx


def bench_scroll(idx: LifecycleIndex, frames: int) -> None:
    from PySide6.QtWidgets import QApplication

    from kvscope.inspector import theme
    from kvscope.inspector.views.lifecycle import LifecycleView

    app = QApplication.instance() or QApplication([])
    theme.apply(app)
    view = LifecycleView()
    view.resize(1600, 700)
    view.show()
    view.set_index(idx)
    app.processEvents()
    for label, rows, zoom in (("wheel (3 rows), whole run", 3, False),
                              ("page, whole run", None, False),
                              ("wheel (3 rows), 200-step window", 3, True)):
        if zoom:
            view.canvas.step0, view.canvas.step1 = 500, 700
        else:
            view.canvas.fit_steps()
        view.scroll.setValue(0)
        times = []
        for _ in range(frames):
            step = rows if rows is not None else view.canvas.visible_rows
            if view.scroll.value() + step > view.scroll.maximum():
                view.scroll.setValue(0)
            t0 = time.perf_counter()
            view.scroll_by(step)
            view.canvas.repaint()
            times.append(time.perf_counter() - t0)
        med, p95 = statistics.median(times), sorted(times)[int(0.95 * len(times))]
        print(f"scroll {label}: {len(idx.order):,} rows ({view.canvas.visible_rows} visible) "
              f"median {med * 1e3:.2f} ms/frame ({1 / med:,.0f} fps), p95 {p95 * 1e3:.2f} ms "
              f"({1 / p95:,.0f} fps)")


def bench_recording(steps: int) -> None:
    import tempfile

    from kvscope.engine.bench.synthetic import SyntheticCache
    from kvscope.engine.events import KVState, ListSink
    from kvscope.engine.events.wire.recording import Recording, RecordingWriter

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "hour.kvtrace"
        cache, sink, state = SyntheticCache(seed=1, gpu_blocks=8192, cpu_blocks=2048,
                                            max_running=32, arrival_rate=0.9), ListSink(), KVState()
        with RecordingWriter(path, {}) as w:
            for step in range(steps):
                stats = cache.step(sink)
                b = {"v": PROTOCOL_VERSION, "epoch": "bench", "seq": step + 1, "step": step,
                     "time": 0.1 * step, "events": sink.drain(), "stats": stats}
                state.apply(b)
                w.add(b, state)
        with Recording(path) as rec:
            t0 = time.perf_counter()
            n = sum(len(b["events"]) for b in rec.batches())
            t_read = time.perf_counter() - t0
            t0 = time.perf_counter()
            idx = LifecycleIndex.from_batches(rec.batches())
            t_all = time.perf_counter() - t0
        print(f"recording of {steps:,} steps, {n:,} events, {len(idx.seqs):,} sequences: "
              f"read {t_read:.2f} s, read + index {t_all:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=10_000)
    ap.add_argument("--frames", type=int, default=300)
    ap.add_argument("--recording-steps", type=int, default=0)
    args = ap.parse_args()
    if args.recording_steps:
        bench_recording(args.recording_steps)
    idx = bench_index(workload(args.seqs))
    bench_scroll(idx, args.frames)


if __name__ == "__main__":
    main()
