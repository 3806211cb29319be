"""The inspector shows the disk tier: a third block-map panel, a DISK row on the timeline
(its cached/free blocks) with the steps where prefetch reads started, arrived and missed
(counted from the events), from a recording of a real three-tier cache manager."""

from __future__ import annotations

import numpy as np

from engine.events import KVState
from inspector.timeline import Timeline
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
    from inspector.app import open_recording

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
