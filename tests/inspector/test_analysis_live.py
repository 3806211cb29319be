"""The analysis dock in live mode: the lifecycle index grows from the stream, adopts the
sequences that were running before the inspector joined, and starts afresh when the
engine restarts."""

from __future__ import annotations

from kvscope.inspector.sources.live import LiveSource
from tests.inspector.test_live import Engine, _converged, endpoints, joined  # noqa: F401
from tests.waiting import HANG_MS


def test_live_lifecycle_joins_late_and_follows(window, qtbot, endpoints):  # noqa: ANN001, F811
    pub, snap = endpoints
    engine = Engine(pub, snap, seed=3)
    engine.run_steps(50)
    engine.wait()  # joined late: these sequences started before the inspector
    live = LiveSource(pub, window.model, snapshot_endpoint=snap)
    window.attach_live(live, pub)
    live.start()
    try:
        qtbot.waitUntil(lambda: joined(live), timeout=HANG_MS)
        engine.run_steps(100)
        engine.wait()
        qtbot.waitUntil(lambda: _converged(live, engine), timeout=HANG_MS)
        idx = window.model.lifecycle
        assert set(window.model.state.seqs) <= set(idx.seqs)  # all alive ones are known
        assert any(p.detail == "joined here" for s in idx.seqs.values() for p in s.phases)
        finished = [s for s in idx.seqs.values() if s.finish_step is not None]
        assert finished and all(s.phases[-1].end_step == s.finish_step + 1 for s in finished)
        assert idx.last_step == window.model.timeline.col("step")[-1]
        window.analysis._refresh_live()
        assert window.analysis.index is idx
        assert window.analysis.lifecycle.canvas.rows == idx.order

        engine.close()
        engine = Engine(pub, snap, seed=4)  # a restart: steps count from 0 again
        engine.run_steps(60)
        engine.wait()
        qtbot.waitUntil(lambda: _converged(live, engine), timeout=HANG_MS)
        assert window.model.lifecycle is not idx
        window.analysis._refresh_live()
        assert window.analysis.index is window.model.lifecycle
        assert set(window.model.state.seqs) <= set(window.model.lifecycle.seqs)
    finally:
        live.stop()
        engine.close()
