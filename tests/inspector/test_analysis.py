"""The analysis dock on a replayed recording: lifecycle rows and selection, filter and
find, range summary, two-moment compare, prefix highlight, keys, alert banners."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QPoint, Qt
from PySide6.QtGui import QFontMetrics

from kvscope.engine.events.analysis.lifecycle import LifecycleIndex
from kvscope.engine.events.analysis.ranges import diff_states, range_summary
from kvscope.engine.events.wire.recording import RecordingError
from kvscope.inspector.views.lifecycle import LABEL_W, LANE_H, ROW_H, elide_middle
from tests.inspector.conftest import expected_state
from tests.waiting import HANG_MS


def test_lifecycle_rows_select_everywhere(replay_window, batches, qtbot):  # noqa: ANN001
    win = replay_window
    panel = win.analysis
    idx = panel.index
    assert idx is LifecycleIndex.for_recording(win.replay.recording)
    assert panel.lifecycle.canvas.rows == idx.order and len(idx.order) > 50
    win.replay.seek_step(150)
    alive = next(sid for sid in idx.order if sid in win.model.state.seqs
                 and win.model.state.seqs[sid].block_table)
    row = idx.order.index(alive)
    panel.lifecycle.scroll_to_row(row)
    canvas = panel.lifecycle.canvas
    y = LANE_H + (row - canvas.top) * ROW_H + ROW_H // 2
    qtbot.mouseClick(canvas, Qt.MouseButton.LeftButton, pos=QPoint(LABEL_W // 2, y))
    assert win.model.selected_seq == alive
    assert win.model.highlighted_blocks("gpu") == list(win.model.state.seqs[alive].block_table)
    assert alive in canvas.tooltip_at(QPoint(LABEL_W + 10, y))
    # a finished sequence: the replay seeks to where it held blocks, then selects it
    done = next(sid for sid in idx.order if idx.seqs[sid].finish_step is not None
                and idx.seqs[sid].finish_step < 100 and idx.seqs[sid].blocks)
    panel._row_clicked(done)
    assert win.model.selected_seq == done and done in win.model.state.seqs


def test_filter_find_and_keys(replay_window, qtbot):  # noqa: ANN001
    win = replay_window
    panel = win.analysis
    target = panel.index.order[7]
    panel.search.setText(target)
    assert panel.lifecycle.canvas.rows == [s for s in panel.index.order if target in s]
    panel.search.clear()
    assert panel.lifecycle.find(target) == target and win.model.selected_seq in (target, None)
    win.replay.seek_step(20)
    win.activateWindow()
    qtbot.keyClick(win, Qt.Key.Key_Right)
    assert win.replay.step == 21
    qtbot.keyClick(win, Qt.Key.Key_Left)
    assert win.replay.step == 20
    qtbot.keyClick(win, Qt.Key.Key_Slash)
    assert panel.search.hasFocus() or panel.tabs.currentIndex() == 0


def test_range_summary_and_compare(replay_window, batches):  # noqa: ANN001
    win = replay_window
    panel = win.analysis
    panel._range_selected(40, 160)
    want = range_summary(panel.index, 40, 160)
    assert panel.range.summary == want
    assert panel.range.values["preemptions"].text() == f"{want['preemptions']:,}"
    win.replay.seek_step(60)
    panel._pin("A")
    win.replay.seek_step(200)
    panel._pin("B")
    d = diff_states(expected_state(batches, 60), expected_state(batches, 200))
    assert panel.compare.diff == d
    g = d["tiers"]["gpu"]
    assert panel.compare.grid_b.marked.tolist() == g["changed"] and g["changed"]
    counts = {panel.compare.table.item(r, 0).text(): int(panel.compare.table.item(r, 1).text())
              for r in range(panel.compare.table.rowCount())}
    assert counts["gpu blocks allocated"] == len(g["allocated"])
    assert counts["sequences that came"] == len(d["seqs_came"])


def test_prefix_tree_highlights_blocks(replay_window):  # noqa: ANN001
    win = replay_window
    panel = win.analysis
    win.replay.seek_step(250)
    tree = panel.prefix.tree
    assert tree.topLevelItemCount() > 0
    top = tree.topLevelItem(0)
    saved = [int(tree.topLevelItem(i).text(1).replace(",", ""))
             for i in range(tree.topLevelItemCount())]
    assert saved == sorted(saved, reverse=True)
    tree.setCurrentItem(top)
    hl = win.model.highlight
    assert hl is not None
    hashes = set(top.data(0, Qt.ItemDataRole.UserRole))
    assert hashes and hashes <= set(panel.index.prefix)
    canon = win.model.state.canonical()["tiers"]["gpu"]["hash"]
    assert hl["gpu"] == [b for b, h in enumerate(canon) if h in hashes]
    assert win.model.highlighted_blocks("gpu") == hl["gpu"]


def test_alert_banners_off_by_default(replay_window):  # noqa: ANN001
    win = replay_window
    panel = win.analysis
    win.replay.seek_step(150)
    assert not panel.alerts.isVisibleTo(win)
    panel.thresholds.enabled = True
    panel.thresholds.max_utilization = 0.0
    panel._on_cursor(150)
    assert panel.alerts.isVisibleTo(win) and "utilization" in panel.alerts.text()


def test_ids_elide_in_the_middle(app):  # noqa: ANN001
    m = QFontMetrics(app.font())
    sid = "chatcmpl-0123456789abcdef-request-xyz"
    short = elide_middle(sid, 90, m)
    assert short != sid and short.startswith("chat") and short.endswith("xyz")


def test_timeline_markers_explain_themselves(replay_window):  # noqa: ANN001
    win = replay_window
    panel = win.analysis
    idx = panel.index
    sid, pre = idx.preemptions[0]
    scatter = win.timelines.curves["gpu_preempt"].scatter
    assert scatter.opts["hoverable"]
    tip = scatter.opts["tip"](x=float(pre.step), y=0.0, data=None)
    assert sid in tip and "preempted" in tip
    # evictions (this synthetic run has none): an index holding one with its cause
    ev_index = LifecycleIndex.from_batches([{"v": 1, "step": 3, "time": 1.0, "events": [
        {"kind": "tier_init", "tier": "gpu", "num_blocks": 8, "block_size": 4},
        {"kind": "evict", "tier": "gpu", "blocks": [1, 2],
         "cause": {"needed_by": "req-9", "blocks_needed": 3, "free_blocks": 1,
                   "policy": "lru", "reason": "allocate"}}]}])
    panel.set_index(ev_index)
    tip = win.timelines.curves["gpu_evict"].scatter.opts["tip"](x=3.0, y=0.0, data=None)
    assert tip == ("step 3: evicted 2 gpu block(s): req-9 needed 3 blocks, 1 free; "
                   "victim: least recently freed first")


def test_compare_with_another_recording(replay_window, recording_path, batches, tmp_path):  # noqa: ANN001
    win = replay_window
    panel = win.analysis
    win.replay.seek_step(100)
    panel._pin("A")
    panel.compare.load_other(str(recording_path), 250)
    d = diff_states(expected_state(batches, 100), expected_state(batches, 250))
    assert panel.compare.diff == d
    bad = tmp_path / "bad.kvtrace"
    bad.write_bytes(b"nope")
    with pytest.raises(RecordingError, match="not a kvscope recording"):
        panel.compare.load_other(str(bad))
    assert panel.compare.diff == d  # the failed load changed nothing


def test_long_recordings_are_indexed_in_the_background(window, recording_path, qtbot,
                                                        monkeypatch):  # noqa: ANN001
    from kvscope.inspector import analysis
    from kvscope.inspector.app import open_recording

    monkeypatch.setattr(analysis, "BACKGROUND_INDEX_STEPS", 100)  # 300 steps: "long"
    rec, _ = open_recording(recording_path)
    window.open_replay(rec, recording_path.name)
    panel = window.analysis
    # the result arrives through the event loop: until it runs, the view says it is busy
    assert panel.index is None and panel.lifecycle.canvas.message.startswith("building")
    qtbot.waitUntil(lambda: panel.index is not None, timeout=HANG_MS)
    assert LifecycleIndex.for_recording(rec) is panel.index  # cached for the recording
    assert panel.lifecycle.canvas.rows == panel.index.order and panel.index.order
