"""Inspector benchmarks (offscreen): block-map frames per second in every colour mode at
1M GPU + 4M CPU blocks while events stream, and seek time in a one-hour recording.

    QT_QPA_PLATFORM=offscreen .venv/bin/python scripts/bench_inspector.py [--frames N]
        [--gpu-blocks 1048576] [--cpu-blocks 4194304] [--seek-steps 36000] [--no-seek]

A frame is what the live source does per 30 Hz tick after the subscriber thread decoded
and applied a step: the frame hand-over (``KVState.clone(reuse=)``), the map's refresh
(the changed blocks' mode codes and the selection's cells, ``ImageItem.setImage``) and a
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

from kvscope.engine.events import PROTOCOL_VERSION, KVState, ListSink  # noqa: E402


def big_state(num_blocks: int, cpu_blocks: int = 0, seed: int = 0) -> KVState:
    """A cache of ``num_blocks`` GPU blocks ~70% in use by 16-block sequences, some shared
    by forks, ~20% cached-free, built by applying real events; plus a host tier of
    ``cpu_blocks`` with ~half of it offloaded (cached)."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(num_blocks).tolist()
    events = [{"kind": "tier_init", "tier": "gpu", "num_blocks": num_blocks, "block_size": 16,
               "format": "fp16"}]
    if cpu_blocks:
        events.append({"kind": "tier_init", "tier": "cpu", "num_blocks": cpu_blocks,
                       "block_size": 16, "format": "fp16"})
        half = list(range(0, cpu_blocks, 2))
        events.append({"kind": "offload", "src": [0] * len(half), "dst": half,
                       "hashes": rng.integers(0, 2**62, len(half)).tolist()})
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
    st.free_gpu = perm[n_seq * 16 + num_blocks // 5:]  # never touched: for the stream
    return st


def stream_batch(st: KVState, frame: int, host: bool) -> dict:
    """One engine step's worth of events against ``big_state``: 8 sequences arrive with
    a 64-block prefill (512 blocks), 8 older ones leave, every running one decodes
    (seq_tokens for 256), and with ``host`` 64 host blocks are offloaded or evicted."""
    events: list[dict] = []
    free = st.free_gpu
    for k in range(8):
        sid, blocks = f"n{frame}_{k}", free[:64]
        del free[:64]
        events += [{"kind": "seq_add", "seq": sid}, {"kind": "seq_start", "seq": sid},
                   {"kind": "alloc", "tier": "gpu", "seq": sid, "blocks": blocks}]
        old = f"n{frame - 4}_{k}"
        if old in st.seqs:
            table = st.seqs[old].block_table
            events += [{"kind": "free", "tier": "gpu", "seq": old, "blocks": list(table)},
                       {"kind": "seq_finish", "seq": old, "reason": "stop"}]
            free.extend(table)
    running = [f"s{i}" for i in range(256)]
    events.append({"kind": "seq_tokens", "seqs": running,
                   "num_tokens": [200 + frame] * len(running)})
    if host:
        t = st.tiers["cpu"]
        base = (frame * 64) % (t.num_blocks - 64)
        blocks = list(range(base, base + 64))
        hashed = [b for b in blocks if b in t.hashes]
        if hashed:
            events.append({"kind": "evict", "tier": "cpu", "blocks": hashed})
        events.append({"kind": "offload", "src": [0] * 64, "dst": blocks,
                       "hashes": list(range(frame * 64, frame * 64 + 64))})
    return {"v": PROTOCOL_VERSION, "step": frame + 1, "time": 0.0, "events": events}


def bench_map(gpu_blocks: int, cpu_blocks: int, frames: int) -> None:
    """Every colour mode at ``gpu_blocks`` + ``cpu_blocks`` while events stream, with no
    selection and with a running sequence selected: per frame, one step's batch goes
    through the wire codec (protocol 3: a bulk step would decode to columns; this mix,
    ~25 ids per event, stays below the bulk threshold and travels as events) and is
    applied to the mirror (the subscriber thread's work), then the live source's frame
    hand-over (``clone(reuse=)`` of the mirror), the map's refresh and a synchronous
    repaint (the GUI thread's). Host tier static, then touched every frame."""
    from PySide6.QtWidgets import QApplication

    from kvscope.engine.events.wire import codec as C
    from kvscope.inspector import theme
    from kvscope.inspector.model import InspectorModel
    from kvscope.inspector.views.block_map import MODES, BlockMapView

    app = QApplication.instance() or QApplication([])
    theme.apply(app)
    codec = C.Codec()
    t0 = time.perf_counter()
    mirror = big_state(gpu_blocks, cpu_blocks)
    print(f"block map: {gpu_blocks:,} GPU + {cpu_blocks:,} CPU blocks (built in "
          f"{time.perf_counter() - t0:.1f} s), {frames} frames per case, view 1000x700 px, "
          f"offscreen; one step of events decoded and applied before each frame; "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"{'mode':<10} {'host tier':<8} {'selected':<9} {'decode':>7} {'apply':>6} "
          f"{'clone':>6} {'refresh':>8} {'paint':>6} {'frame ms':>9} {'fps':>6} "
          f"{'fps w/ apply':>13}")
    model = InspectorModel()
    view = BlockMapView(model)
    view.resize(1000, 700)
    view.show()
    model.set_state(mirror.clone())
    app.processEvents()
    frame_no = as_columns = 0
    for mode in MODES:
        view.colour_by.setCurrentText(mode)
        for host in (False, True):
            for selected in (None, "s5"):  # s5: a running sequence (decodes every step)
                model.select_seq(selected)
                app.processEvents()
                rows = []
                for _ in range(frames):
                    frame_no += 1
                    batch = stream_batch(mirror, frame_no, host)
                    data = codec.encode(C.make_batch("bench", frame_no, batch["step"], 0.0,
                                                     batch["events"]))
                    t0 = time.perf_counter()
                    msg = codec.decode(data)
                    t1 = time.perf_counter()
                    as_columns += "columns" in msg
                    mirror.apply(msg)
                    t2 = time.perf_counter()
                    frame = mirror.clone(reuse=model.state)
                    t3 = time.perf_counter()
                    model.set_state(frame)  # refreshes the map
                    t4 = time.perf_counter()
                    view.canvas.viewport().repaint()
                    t5 = time.perf_counter()
                    rows.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t2))
                med = [statistics.median(r[i] for r in rows) * 1e3 for i in range(6)]
                print(f"{mode:<10} {'changes' if host else 'static':<8} "
                      f"{'sequence' if selected else '-':<9} {med[0]:>7.1f} {med[1]:>6.1f} "
                      f"{med[2]:>6.1f} {med[3]:>8.1f} {med[4]:>6.1f} {med[5]:>9.1f} "
                      f"{1e3 / med[5]:>6.1f} {1e3 / (med[0] + med[1] + med[5]):>13.1f}",
                      flush=True)
    print(f"steps that travelled as columns (protocol 3): {as_columns} of {frame_no}; "
          f"left by the columnar apply to the per-event reference: {mirror.columns_refused}")
    view.close()


def bench_seek(steps: int) -> None:
    from PySide6.QtWidgets import QApplication

    from kvscope.engine.bench.synthetic import SyntheticCache
    from kvscope.engine.events.wire.recording import Recording, RecordingWriter
    from kvscope.inspector import theme
    from kvscope.inspector.app import open_recording
    from kvscope.inspector.window import MainWindow

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
        # The analysis dock builds its lifecycle index on a thread after open; seeks
        # are timed once it is in (while it builds, it competes with them for the GIL).
        while win.analysis.index is None and time.perf_counter() - t < 120:
            app.processEvents()
            time.sleep(0.01)
        app.processEvents()
        print(f"lifecycle index ready: {time.perf_counter() - t:.2f} s after open began")
        rng = np.random.default_rng(0)
        times = []
        import cProfile
        import pstats

        profile = bool(os.environ.get("KVSCOPE_PROFILE"))  # timings under cProfile
        prof = cProfile.Profile()
        for target in rng.integers(0, steps, 20).tolist():
            t = time.perf_counter()
            if profile:
                prof.enable()
            win.replay.seek_step(int(target))
            app.processEvents()
            if profile:
                prof.disable()
            times.append(time.perf_counter() - t)
        if profile:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
        print(f"seek to a random step (state_at + event-log context + redraw of all views), "
              f"20 seeks: median {statistics.median(times) * 1e3:.0f} ms, "
              f"max {max(times) * 1e3:.0f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, default=30)
    ap.add_argument("--gpu-blocks", type=int, default=1 << 20)
    ap.add_argument("--cpu-blocks", type=int, default=4 << 20)
    ap.add_argument("--seek-steps", type=int, default=36_000)
    ap.add_argument("--no-seek", action="store_true")
    args = ap.parse_args()
    bench_map(args.gpu_blocks, args.cpu_blocks, args.frames)
    if not args.no_seek:
        bench_seek(args.seek_steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
