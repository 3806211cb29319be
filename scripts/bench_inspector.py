"""Inspector benchmarks (offscreen): block-map updates per second at 64k, 256k and 1M
blocks, and seek time in a one-hour recording.

    QT_QPA_PLATFORM=offscreen .venv/bin/python scripts/bench_inspector.py [--frames N]
        [--sizes 65536,262144,1048576] [--seek-steps 36000] [--no-seek]

A map update is what the live timer does per frame: KVState.block_codes per tier, the
cell codes (with or without colour-by-owner / a selection), ImageItem.setImage, and a
synchronous repaint of the map widget. Prints numbers; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from engine.events import PROTOCOL_VERSION, KVState, ListSink  # noqa: E402


def big_state(num_blocks: int, seed: int = 0) -> KVState:
    """A cache of ``num_blocks`` GPU blocks ~70% in use by 16-block sequences, some shared
    by forks, ~20% cached-free, built by applying real events."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(num_blocks).tolist()
    events = [{"kind": "tier_init", "tier": "gpu", "num_blocks": num_blocks, "block_size": 16,
               "format": "fp16"}]
    n_seq = int(num_blocks * 0.7) // 16
    for i in range(n_seq):
        sid = f"s{i}"
        events.append({"kind": "seq_add", "seq": sid, "prompt_tokens": 200})
        events.append({"kind": "alloc", "tier": "gpu", "seq": sid,
                       "blocks": perm[i * 16:(i + 1) * 16]})
        if i % 10 == 0:
            events.append({"kind": "seq_add", "seq": f"f{i}", "parent": sid})
            events.append({"kind": "fork", "tier": "gpu", "seq": f"f{i}", "parent": sid,
                           "blocks": perm[i * 16:(i + 1) * 16]})
    cached = perm[n_seq * 16: n_seq * 16 + num_blocks // 5]
    events.append({"kind": "seq_add", "seq": "tmp"})
    events.append({"kind": "alloc", "tier": "gpu", "seq": "tmp", "blocks": cached})
    events.append({"kind": "store", "tier": "gpu", "blocks": cached,
                   "hashes": rng.integers(0, 2**62, len(cached)).tolist()})
    events.append({"kind": "free", "tier": "gpu", "seq": "tmp", "blocks": cached})
    events.append({"kind": "seq_finish", "seq": "tmp", "reason": "stop"})
    st = KVState()
    st.apply({"v": PROTOCOL_VERSION, "step": 0, "time": 0.0, "events": events})
    return st


def bench_map(sizes: list[int], frames: int) -> None:
    from PySide6.QtWidgets import QApplication

    from inspector import theme
    from inspector.model import InspectorModel
    from inspector.views.block_map import BlockMapView

    app = QApplication.instance() or QApplication([])
    theme.apply(app)
    print(f"block map, {frames} frames per case, view 1000x700 px, offscreen")
    print(f"{'blocks':>9} {'mode':<16} {'update ms':>10} {'update+paint ms':>16} {'fps':>7}")
    for n in sizes:
        st = big_state(n)
        model = InspectorModel()
        view = BlockMapView(model)
        view.resize(1000, 700)
        view.show()
        model.set_state(st)
        app.processEvents()
        for mode in ("state", "owner", "selected seq"):
            view.by_owner.setChecked(mode == "owner")
            model.select_seq("s7" if mode == "selected seq" else None)
            upd, full = [], []
            for _ in range(frames):
                t0 = time.perf_counter()
                view.refresh()
                t1 = time.perf_counter()
                view.canvas.viewport().repaint()
                t2 = time.perf_counter()
                upd.append(t1 - t0)
                full.append(t2 - t0)
            u, f = statistics.median(upd) * 1e3, statistics.median(full) * 1e3
            print(f"{n:>9,} {mode:<16} {u:>10.1f} {f:>16.1f} {1e3 / f:>7.1f}", flush=True)
        view.close()
        view.deleteLater()
        app.processEvents()


def bench_seek(steps: int) -> None:
    from PySide6.QtWidgets import QApplication

    from engine.events.recording import Recording, RecordingWriter
    from engine.events.synthetic import SyntheticCache
    from inspector import theme
    from inspector.app import open_recording
    from inspector.window import MainWindow

    app = QApplication.instance() or QApplication([])
    theme.apply(app)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "hour.kvtrace"
        t = time.perf_counter()
        cache, sink, state = SyntheticCache(seed=1, gpu_blocks=8192, cpu_blocks=2048,
                                            max_running=32, arrival_rate=0.9), ListSink(), KVState()
        # The writer's default keyframe spacing: what the engine's recordings get.
        with RecordingWriter(path, {}) as w:
            for step in range(steps):
                stats = cache.step(sink)
                b = {"v": PROTOCOL_VERSION, "epoch": "bench", "seq": step + 1, "step": step,
                     "time": 0.1 * step, "events": sink.drain(), "stats": stats}
                state.apply(b)
                w.add(b, state)
        print(f"\nseek: recording of {steps:,} steps ({steps * 0.1 / 3600:.2f} h at 10 steps/s), "
              f"8192+2048 blocks, {len(Recording(path).keyframe_steps)} keyframes: "
              f"{path.stat().st_size / 2**20:.1f} MiB, written in {time.perf_counter() - t:.0f} s")
        rec, _ = open_recording(path)
        win = MainWindow()
        win.resize(1600, 1000)
        win.show()
        t = time.perf_counter()
        win.open_replay(rec, path.name)
        app.processEvents()
        print(f"open (index + timeline pass + first frame): {time.perf_counter() - t:.2f} s")
        rng = np.random.default_rng(0)
        times = []
        import cProfile
        import pstats

        prof = cProfile.Profile()
        for target in rng.integers(0, steps, 20).tolist():
            t = time.perf_counter()
            prof.enable()
            win.replay.seek_step(int(target))
            app.processEvents()
            prof.disable()
            times.append(time.perf_counter() - t)
        if os.environ.get("KVSCOPE_PROFILE"):
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
        print(f"seek to a random step (state_at + event-log context + redraw of all views), "
              f"20 seeks: median {statistics.median(times) * 1e3:.0f} ms, "
              f"max {max(times) * 1e3:.0f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=30)
    ap.add_argument("--sizes", default="65536,262144,1048576")
    ap.add_argument("--seek-steps", type=int, default=36_000)
    ap.add_argument("--no-seek", action="store_true")
    args = ap.parse_args()
    bench_map([int(s) for s in args.sizes.split(",")], args.frames)
    if not args.no_seek:
        bench_seek(args.seek_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
