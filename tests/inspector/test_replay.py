"""Replay: the views show exactly KVState at every step sought; controls and exports."""

from __future__ import annotations

import csv

import numpy as np
import pytest
from PySide6.QtCore import QEvent, QPoint, QPointF, Qt
from PySide6.QtGui import QMouseEvent
from PySide6.QtWidgets import QApplication

from kvscope.engine.events import schema as S
from kvscope.inspector import palette as P
from kvscope.inspector.views.sequences import COLUMNS
from tests.inspector.conftest import expected_state
from tests.waiting import HANG_MS


def _check_frame(win, truth) -> None:  # noqa: ANN001
    """Block map cells and the sequence table equal the ground-truth KVState."""
    assert win.model.state.step == truth.step
    for tier, t in truth.tiers.items():
        cells = win.block_map.cells(tier)
        # Independent of block_codes: the state code straight from ref counts and hashes.
        want = np.where(t.ref > 1, S.BLOCK_SHARED, np.where(t.ref == 1, S.BLOCK_USED, 0))
        cached = [b for b in t.hashes if t.ref[b] == 0]
        want[cached] = S.BLOCK_CACHED
        np.testing.assert_array_equal(cells, want.astype(np.uint8))
    rows = {r[0]: r for r in win.sequences.visible_rows()}
    assert set(rows) == set(truth.seqs)
    c = {name: i for i, name in enumerate(COLUMNS)}
    for sid, s in truth.seqs.items():
        r = rows[sid]
        assert r[c["status"]] == s.status and r[c["tier"]] == s.tier
        assert r[c["blocks"]] == len(s.block_table)
        assert r[c["prompt"]] == s.prompt_tokens
        assert r[c["hit tok"]] == s.hit_tokens and r[c["preempt"]] == s.preemptions
        ref = truth.tiers[s.tier].ref
        assert r[c["shared"]] == sum(1 for b in s.block_table if ref[b] > 1)


def test_seek_shows_kvstate_at_each_step(replay_window, batches, qtbot):  # noqa: ANN001
    win = replay_window
    for step in (0, 37, 150, 299, 120, 51, 49):  # forwards, backwards, across keyframes
        win.replay.seek_step(step)
        truth = expected_state(batches, step)
        assert win.model.state.canonical() == truth.canonical()
        _check_frame(win, truth)


def test_step_play_and_slider(replay_window, batches, qtbot):  # noqa: ANN001
    win, rp = replay_window, replay_window.replay
    rp.seek_step(10)
    for want in (11, 12, 13):
        rp.step_forward()
        _check_frame(win, expected_state(batches, want))
    rp.step_back()
    _check_frame(win, expected_state(batches, 12))
    win.replay_bar.slider.setValue(200)
    assert rp.step == 200
    _check_frame(win, expected_state(batches, 200))
    rp.to_end()
    assert rp.step == 299 and win.replay_bar.slider.value() == 299
    rp.set_speed(16.0)
    rp.seek_step(250)
    rp.play()
    qtbot.waitUntil(lambda: not rp.playing, timeout=HANG_MS)  # 50 steps at 16x
    assert rp.step == 299
    _check_frame(win, expected_state(batches, 299))


def _viewport_pos(win, tier: str, block: int) -> QPoint:  # noqa: ANN001
    canvas = win.block_map.canvas
    return canvas.mapFromScene(win.block_map.scene_pos_of(tier, block))


def _hover(widget, pos: QPoint) -> None:  # noqa: ANN001
    """A real mouse-move event at ``pos`` (QTest's mouseMove sends none offscreen)."""
    ev = QMouseEvent(QEvent.Type.MouseMove, QPointF(pos), QPointF(widget.mapToGlobal(pos)),
                     Qt.MouseButton.NoButton, Qt.MouseButton.NoButton,
                     Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(widget, ev)


@pytest.mark.parametrize("tier", ["gpu", "cpu"])
def test_hover_and_click_pick_the_block_under_the_mouse(replay_window, batches, qtbot, tier,
                                                        monkeypatch):  # noqa: ANN001
    import pyqtgraph

    # pyqtgraph drops a mouse move that comes sooner than 1/mouseRateLimit s after the
    # last one; off, every move counts however fast the test sends them
    monkeypatch.setitem(pyqtgraph.CONFIG_OPTIONS, "mouseRateLimit", 0)
    win = replay_window
    win.replay.seek_step(200)
    truth = expected_state(batches, 200)
    t = truth.tiers[tier]
    owned = [b for s in truth.seqs.values() if s.tier == tier for b in s.block_table]
    for block in (0, t.num_blocks - 1, t.num_blocks // 2, *owned[:3]):
        pos = _viewport_pos(win, tier, block)
        _hover(win.block_map.canvas.viewport(), pos)
        assert win.block_map.info.text().startswith(f"{tier.upper()} block {block} ")
        qtbot.mouseClick(win.block_map.canvas.viewport(), Qt.MouseButton.LeftButton, pos=pos)
        assert win.model.selected_block == (tier, block)
        owners = sorted(s.seq_id for s in truth.seqs.values()
                        if s.tier == tier and block in s.block_table)
        shown = sorted(win.sequences.owners.item(i).text()
                       for i in range(win.sequences.owners.count()))
        assert shown == owners
        if owners:
            assert f"ref {len(owners)}" in win.block_map.info.text() or t.ref[block] > 1
    # Off the grid (the panel's margin) picks nothing.
    assert win.block_map.pick(win.block_map.panels[tier].view.mapViewToScene(
        win.block_map.panels[tier].view.mapFromView(win.block_map.scene_pos_of(tier, 0))
        - (win.block_map.scene_pos_of(tier, 1) - win.block_map.scene_pos_of(tier, 0)) * 3
    )) is None


def test_selecting_a_sequence_highlights_its_blocks(replay_window, batches, artifacts):  # noqa: ANN001
    win = replay_window
    win.replay.seek_step(180)
    truth = expected_state(batches, 180)
    sid = max((s for s in truth.seqs.values() if s.tier == "gpu"),
              key=lambda s: len(s.block_table)).seq_id
    row = [r[0] for r in win.sequences.visible_rows()].index(sid)
    win.sequences.table.selectRow(row)
    assert win.model.selected_seq == sid
    # a long id elides in the middle in its cell; the tooltip gives it whole
    assert win.sequences.table.textElideMode() == Qt.TextElideMode.ElideMiddle
    # ... on one line: wrapped, ids whose hex starts with a letter showed as "chatcmpl-..."
    assert not win.sequences.table.wordWrap()
    assert win.sequences.proxy.index(row, 0).data(Qt.ItemDataRole.ToolTipRole) == sid
    table = truth.seqs[sid].block_table
    cells = win.block_map.cells("gpu")
    assert all(cells[b] < P.DIM_OFFSET for b in table)
    others = np.setdiff1d(np.arange(cells.size), table)
    assert (cells[others] >= P.DIM_OFFSET).all()
    bt = win.sequences.block_table
    assert [int(bt.item(i, 1).text()) for i in range(bt.rowCount())] == table
    for i, b in enumerate(table):
        mark = bt.item(i, 3).text()
        assert ("shared" in mark) == (truth.tiers["gpu"].ref[b] > 1)
        assert ("cached prefix" in mark) == (b in truth.tiers["gpu"].hashes)
    win.export_png(artifacts / "inspector_replay_selected.png")
    # Selecting a block in the block table lists its sequences, keeping the seq selected.
    bt.selectRow(0)
    assert win.model.selected_block == ("gpu", table[0]) and win.model.selected_seq == sid
    assert sid in [win.sequences.owners.item(i).text() for i in range(win.sequences.owners.count())]


def test_colour_by_owner_and_filter(replay_window, batches, artifacts):  # noqa: ANN001
    win = replay_window
    win.replay.seek_step(299)
    truth = expected_state(batches, 299)
    win.block_map.set_mode("owner")
    cells = win.block_map.cells("gpu")
    for s in truth.seqs.values():
        if s.tier != "gpu":
            continue
        for b in s.block_table:
            if truth.tiers["gpu"].ref[b] == 1:
                assert cells[b] == P.OWNER_BASE + P.owner_index(s.seq_id)
            else:
                assert cells[b] == S.BLOCK_SHARED
    win.export_png(artifacts / "inspector_replay_by_owner.png")
    win.block_map.set_mode("state")
    statuses = [s.status for s in truth.seqs.values()]
    rare = min(set(statuses), key=statuses.count)
    win.sequences.filter.setText(rare.upper())  # case-insensitive, any column
    rows = win.sequences.visible_rows()
    assert rows and all(rare in r for r in rows)
    assert len(rows) == statuses.count(rare) < len(statuses)
    win.sequences.filter.setText("")
    win.sequences.table.sortByColumn(COLUMNS.index("blocks"), Qt.SortOrder.DescendingOrder)
    blocks = [r[COLUMNS.index("blocks")] for r in win.sequences.visible_rows()]
    assert blocks == sorted(blocks, reverse=True)


def test_timeline_click_seeks(replay_window, qtbot):  # noqa: ANN001
    win = replay_window
    win.replay.seek_step(5)
    vb = win.timelines.plots["gpu"].vb
    vb.setXRange(0, 299, padding=0)
    QApplication.processEvents()  # what the range change posted runs before the click
    lo, hi = vb.viewRange()[1]
    target = vb.mapViewToScene(QPointF(123.4, (lo + hi) / 2))
    pos = win.timelines.canvas.mapFromScene(target)
    qtbot.mouseClick(win.timelines.canvas.viewport(), Qt.MouseButton.LeftButton, pos=pos)
    assert abs(win.replay.step - 123) <= 2
    assert win.timelines.cursors[0].value() == win.replay.step


def test_event_log_filters_and_pauses(replay_window, batches, qtbot):  # noqa: ANN001
    win = replay_window
    log = win.event_log
    win.right_tabs.setCurrentWidget(log)  # a hidden tab rebuilds when shown (below)
    win.replay.seek_step(100)
    lo = max(0, 100 - 50)
    want = [(b["step"], e) for b in batches if lo <= b["step"] <= 100 for e in b["events"]]
    assert len(log.log_model.rows) == min(len(want), 5000)
    assert log.log_model.rows[-1][1] == want[-1][1]["kind"]
    log.kind.setCurrentText(S.ALLOC)
    assert log.log_model.rows and all(r[1] == S.ALLOC for r in log.log_model.rows)
    sid = log.log_model.rows[-1][2]
    log.kind.setCurrentIndex(0)
    log.seq.setText(sid)
    assert all(sid in r[2].split(",") for r in log.log_model.rows)
    log.seq.setText("")
    # Scrolled up: new events are held back, the rows being read stay put.
    sb = log.table.verticalScrollBar()
    sb.setValue(0)
    assert log.paused
    n = len(log.log_model.rows)
    win.replay.step_forward()
    assert len(log.log_model.rows) == n and log.pending > 0 and "paused" in log.status.text()
    sb.setValue(sb.maximum())
    assert log.pending == 0 and len(log.log_model.rows) > n


def test_hidden_event_log_catches_up_when_shown(replay_window, batches):  # noqa: ANN001
    win = replay_window
    log = win.event_log
    win.right_tabs.setCurrentWidget(win.sequences)
    win.replay.seek_step(100)
    win.replay.seek_step(200)  # seeks while the log's tab is hidden: no rebuild yet
    win.replay.step_forward()
    assert log._stale  # deferred, not rebuilt per seek
    win.right_tabs.setCurrentWidget(log)
    assert not log._stale
    step = win.replay.step  # the log: the seek's 50 steps of context, then the step
    want = [(b["step"], e) for b in batches if 200 - 50 <= b["step"] <= step
            for e in b["events"]]
    assert len(log.log_model.rows) == min(len(want), 5000)
    assert log.log_model.rows[-1][0] == want[-1][0]
    assert log.log_model.rows[-1][1] == want[-1][1]["kind"]


def test_exports(replay_window, tmp_path, artifacts):  # noqa: ANN001
    win = replay_window
    win.replay.seek_step(250)
    win.export_png(tmp_path / "map.png", win.block_map)
    win.export_csv(tmp_path / "t.csv")
    assert (tmp_path / "map.png").stat().st_size > 1000
    with open(tmp_path / "t.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 300 and rows[42]["step"] == "42"
    assert {"gpu_used", "gpu_cached", "gpu_free", "running", "hit_rate"} <= set(rows[0])
    win.export_png(artifacts / "inspector_replay.png")
