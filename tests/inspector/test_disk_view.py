"""The inspector shows the disk tier: a third block-map panel, a DISK row on the timeline
(its cached/free blocks) with the steps where prefetch reads started, arrived and missed
(counted from the events), from a recording of a real three-tier cache manager."""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import QPoint

from kvscope.engine.events import KVState
from kvscope.inspector.timeline import Timeline
from tests.inspector.batches import disk_batches
from tests.inspector.conftest import write_recording


def test_timeline_counts_prefetch_blocks_per_step():
    batches = disk_batches(200, seed=1)
    tl = Timeline()
    tl.extend(batches)
    started = sum(len(e["src"]) for b in batches for e in b["events"] if e["kind"] == "prefetch")
    arrived = sum(len(e["src"]) for b in batches for e in b["events"] if e["kind"] == "disk_load")
    missed = sum(e.get("missed", 0) for b in batches for e in b["events"]
                 if e["kind"] == "disk_load")
    assert started > 0 and missed > 0
    assert tl.col("prefetched").sum() == started and tl.col("arrived").sum() == arrived
    assert tl.col("missed").sum() == missed
    state = KVState()
    for b in batches:
        state.apply(b)
    t = state.tiers["disk"]
    assert tl.col("disk_cached")[-1] + tl.col("disk_free")[-1] == t.num_blocks


def test_window_draws_three_tiers_and_prefetches(window, tmp_path, qapp, artifacts):  # noqa: ANN001
    from kvscope.inspector.app import open_recording

    batches = disk_batches(200, seed=1)
    path = write_recording(tmp_path / "disk.kvtrace", batches)
    rec, notes = open_recording(path)
    assert notes == []
    window.open_replay(rec, path.name)
    window.replay.seek_step(199)
    qapp.processEvents()
    assert set(window.block_map.panels) == {"gpu", "cpu", "disk"}
    tv = window.timelines
    assert "disk" in tv._shown and tv.plots["disk"].isVisible()
    xs, ys = tv.curves["prefetch"].getData()
    assert len(xs) > 0 and np.all(ys > 0)
    window.grab().save(str(artifacts / "inspector-disk-tier.png"))
    # the lifecycle: a request's prefetch is on its row, its hover says how it ended
    from kvscope.engine.events.analysis import lifecycle as L
    from kvscope.inspector.views.lifecycle import LABEL_W, LANE_H, ROW_H

    panel = window.analysis
    canvas = panel.lifecycle.canvas
    for outcome, words in ((L.RECOMPUTED, "the rest recomputed"), (L.ARRIVED, "arrived by")):
        sid = next(s for s in canvas.rows if any(
            pf.outcome == outcome for pf in panel.index.seqs[s].prefetches))
        pf = panel.index.seqs[sid].prefetches[0]
        row = canvas.rows.index(sid)
        panel.lifecycle.scroll_to_row(row)
        canvas.step0, canvas.step1 = max(0, pf.start_step - 12), pf.start_step + 12
        y = LANE_H + (row - canvas.top) * ROW_H + ROW_H // 2
        x = next(x for x in range(LABEL_W, canvas.width())
                 if canvas._step_at(x) >= pf.start_step)
        assert words in canvas.tooltip_at(QPoint(x, y)), outcome
    panel.show_tab(0)
    qapp.processEvents()
    panel.grab().save(str(artifacts / "inspector-disk-prefetch-lifecycle.png"))


def test_lifecycle_has_each_requests_prefetch_and_how_it_ended():
    """Per request, its prefetch: blocks started, arrived (or missed) by the step of the
    last read, and the outcome: all arrived before it started, or it gave up waiting and
    recomputed (every fifth request here)."""
    from kvscope.engine.events.analysis import lifecycle as L

    batches = disk_batches(200, seed=1)
    idx = L.LifecycleIndex.from_batches(batches)
    started: dict[str, int] = {}
    for b in batches:
        for e in b["events"]:
            if e["kind"] == "prefetch":
                started[e["seq"]] = started.get(e["seq"], 0) + len(e["src"])
    spans = {sid: idx.seqs[sid].prefetches for sid in started}
    assert all(sum(pf.blocks for pf in ps) == started[sid] for sid, ps in spans.items())
    outcomes = [pf.outcome for ps in spans.values() for pf in ps]
    assert outcomes.count(L.ARRIVED) > 0 and outcomes.count(L.RECOMPUTED) > 0
    for sid, ps in spans.items():
        for pf in ps:
            gave_up = int(sid[1:]) % 5 == 0
            assert pf.outcome == (L.RECOMPUTED if gave_up else L.ARRIVED), sid
            if pf.outcome == L.ARRIVED:
                assert pf.arrived + pf.missed == pf.blocks
                assert pf.start_step < pf.arrive_step + 1 <= pf.end_step + 1
            else:
                assert pf.end_step == pf.start_step and pf.arrive_step is None
    assert any(pf.missed for ps in spans.values() for pf in ps)
