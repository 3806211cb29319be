"""Readable at any size: legends flow onto more lines instead of overlapping, small pools
get cell borders and block ids (large ones stay an image), timeline axes keep their tick
labels apart; and every key of issue 21 does what it says, sent as real key events."""

from __future__ import annotations

import numpy as np
import pytest
from PySide6.QtCore import QRect, Qt
from PySide6.QtWidgets import QLineEdit

from kvscope.engine.events import KVState
from kvscope.inspector import analysis
from kvscope.inspector.model import InspectorModel
from kvscope.inspector.views.block_map import BlockMapView
from kvscope.inspector.views.cell_grid import GRID_MAX_BLOCKS
from kvscope.inspector.views.timelines import SparseAxis


def _rect(w) -> QRect:  # noqa: ANN001
    return QRect(w.mapTo(w.window(), w.rect().topLeft()), w.size())


@pytest.mark.parametrize("width", [700, 1000, 1300, 1600, 2400])
def test_legends_never_overlap(replay_window, qapp, width):  # noqa: ANN001
    win = replay_window
    win.resize(width, 1000)
    win.replay.seek_step(150)
    for _ in range(3):
        qapp.processEvents()
    for legend_w, below in ((win.block_map.legend, win.block_map.canvas),
                            (win.timelines.legend, win.timelines.canvas),
                            (win.analysis.phase_legend, win.analysis.lifecycle)):
        labels = legend_w.labels
        assert len(labels) >= 4
        rects = [_rect(lab) for lab in labels]
        for i, a in enumerate(rects):
            assert a.width() >= lab_min(labels[i]), "an entry was squeezed"
            for b in rects[i + 1:]:
                assert not a.intersects(b), f"legend entries overlap at {width}px"
        legend = _rect(legend_w)
        assert all(legend.contains(r) for r in rects), "an entry spills out of its legend"
        # nothing below the legend is covered by it
        assert legend.bottom() < _rect(below).top()
    if width <= 1000:  # a narrow window: the entries took more than one line
        assert len({_rect(lab).top() for lab in win.timelines.legend.labels}) > 1


def lab_min(lab) -> int:  # noqa: ANN001
    return lab.sizeHint().width()


def test_no_colour_by_owner_checkbox(window):  # noqa: ANN001
    from PySide6.QtWidgets import QCheckBox

    texts = [c.text() for c in window.block_map.findChildren(QCheckBox)]
    assert not any("owner" in t for t in texts)
    menu = next(a.menu() for a in window.menuBar().actions() if a.text() == "&View")
    sub = next(a.menu() for a in menu.actions() if a.menu() is not None)
    modes = [a.text() for a in sub.actions()]
    assert modes == list(window.block_map.colour_by.itemText(i)
                         for i in range(window.block_map.colour_by.count()))
    sub.actions()[1].trigger()
    assert window.block_map.mode == modes[1] and sub.actions()[1].isChecked()
    window.block_map.set_mode("state")
    assert sub.actions()[0].isChecked() and not sub.actions()[1].isChecked()
    with pytest.raises(ValueError, match="unknown colour mode"):
        window.block_map.set_mode("rainbow")


def _pool(num_blocks: int) -> KVState:
    st = KVState()
    st.apply({"v": 2, "step": 0, "events": [
        {"kind": "tier_init", "tier": "gpu", "num_blocks": num_blocks, "block_size": 16},
        {"kind": "seq_add", "seq": "a", "prompt_tokens": 40},
        {"kind": "alloc", "tier": "gpu", "seq": "a", "blocks": [0, 1, 2]}]})
    return st


def test_small_pool_draws_borders_and_ids(qtbot, qapp):  # noqa: ANN001
    model = InspectorModel()
    view = BlockMapView(model)
    qtbot.addWidget(view)
    view.resize(900, 600)
    view.show()
    model.set_state(_pool(64))
    qapp.processEvents()
    grid = view.panels["gpu"].grid
    assert grid is not None and grid.num_blocks == 64
    shot = view.canvas.grab().toImage()
    # the ids are drawn: the cell of block 0 holds pixels of its text colour, unlike
    # the same map drawn without the grid
    grid.hide()
    qapp.processEvents()
    bare = view.canvas.grab().toImage()
    grid.show()
    assert shot != bare
    # a large pool stays an image: no grid item at all
    model.set_state(_pool(GRID_MAX_BLOCKS + 1))
    qapp.processEvents()
    assert view.panels["gpu"].grid is None
    model.set_state(_pool(100))
    qapp.processEvents()
    assert view.panels["gpu"].grid is not None and view.panels["gpu"].grid.num_blocks == 100


def test_timeline_axes_keep_labels_apart(qapp) -> None:  # noqa: ANN001 - items need a QApplication
    ax = SparseAxis("left")
    for lo, hi, px in ((0, 80, 44), (-65, 574, 44), (0, 1e6, 30), (0, 1, 300), (3, 3.5, 60),
                       (-1, 9, 44), (-1, 9, 200)):
        (step, _), = ax.tickSpacing(lo, hi, px)
        assert step * px / (hi - lo) >= SparseAxis.MIN_TICK_PX  # pixels between labels
        if hi - lo >= 5:  # counts: whole-number ticks (2.5 would print as "2")
            assert float(step).is_integer(), (lo, hi, px, step)
        ticks = np.arange(np.ceil(lo / step) * step, hi, step)
        assert len(ticks) >= 1


def test_keys_play_step_goto_find_filter(replay_window, qtbot, monkeypatch):  # noqa: ANN001
    win = replay_window
    panel = win.analysis
    win.activateWindow()
    win.replay.seek_step(20)
    win.replay_bar.fwd.setFocus()  # a focused button must not eat the space
    qtbot.keyClick(win.replay_bar.fwd, Qt.Key.Key_Space)
    assert win.replay.playing and win.replay.step == 20
    qtbot.keyClick(win, Qt.Key.Key_Space)
    assert not win.replay.playing
    qtbot.keyClick(win, Qt.Key.Key_Right)
    qtbot.keyClick(win, Qt.Key.Key_Right)
    assert win.replay.step == 22
    qtbot.keyClick(win, Qt.Key.Key_Left)
    assert win.replay.step == 21
    qtbot.keyClick(win, Qt.Key.Key_End)
    assert win.replay.step == win.replay.steps[-1]
    qtbot.keyClick(win, Qt.Key.Key_Home)
    assert win.replay.step == win.replay.steps[0]

    asked = []
    monkeypatch.setattr(analysis.QInputDialog, "getInt",
                        lambda *a, **k: (asked.append(a[3]) or 123, True))
    qtbot.keyClick(win, Qt.Key.Key_G)
    assert asked and win.replay.step == 123

    # Ctrl-F: the search box takes the focus; Enter selects the request typed
    target = next(s for s in panel.index.order if s in win.model.state.seqs)
    qtbot.keyClick(win, Qt.Key.Key_F, Qt.KeyboardModifier.ControlModifier)
    assert panel.search.hasFocus() and "find" in panel.search.placeholderText()
    qtbot.keyClicks(panel.search, target)
    qtbot.keyClick(panel.search, Qt.Key.Key_Return)
    assert win.model.selected_seq == target
    # typing a space, a 'g' or an arrow in the box edits it; it does not play or seek
    step = win.replay.step
    qtbot.keyClicks(panel.search, " g")
    qtbot.keyClick(panel.search, Qt.Key.Key_Left)
    assert panel.search.text() == target + " g" and not win.replay.playing
    assert win.replay.step == step and not asked[1:]
    qtbot.keyClick(panel.search, Qt.Key.Key_Escape)
    assert panel.search.text() == ""

    # '/': filter mode; the rows follow what is typed
    win.replay_bar.fwd.setFocus()
    qtbot.keyClick(win, Qt.Key.Key_Slash)
    assert isinstance(qapp_focus(), QLineEdit) and panel.search.hasFocus()
    assert "filter" in panel.search.placeholderText()
    qtbot.keyClicks(panel.search, target)
    assert panel.lifecycle.canvas.rows == [s for s in panel.index.order if target in s]
    panel.search.clear()


def qapp_focus():  # noqa: ANN201
    from PySide6.QtWidgets import QApplication

    return QApplication.focusWidget()


def test_costs_and_alerts_on_the_main_window(replay_window, qapp):  # noqa: ANN001
    from kvscope.engine.events.analysis.costs import cost_series

    win = replay_window
    panel = win.analysis
    want = cost_series(panel.index)
    for key in ("recompute_share", "fragmentation", "prefix_saved"):
        x, y = win.timelines.curves[key].getData()
        assert np.array_equal(x, want["step"])
        assert np.allclose(y, want[key] * 100, equal_nan=True)
    x, y = win.timelines.curves["decode_ms"].getData()
    has = np.isfinite(want["decode_ms"])
    assert len(x) == int(has.sum()) > 0 and np.allclose(y, want["decode_ms"][has])

    # alerts: off by default; switched on in the Alerts tab, the banner shows in the main
    # window (above the block map, outside the dock) and the thresholds show as lines
    win.replay.seek_step(150)
    assert not panel.alerts.isVisibleTo(win)
    assert not win.timelines.threshold_lines["gpu"].isVisible()
    panel.alert_controls["max_utilization"].setValue(1)
    panel.alert_controls["enabled"].setChecked(True)
    qapp.processEvents()
    assert panel.alerts.isVisibleTo(win) and "utilization" in panel.alerts.text()
    assert panel.alerts.parentWidget() is win.centralWidget()
    assert _rect(panel.alerts).bottom() < _rect(win.block_map).top()
    assert win.timelines.threshold_lines["gpu"].isVisible()
    assert win.timelines.threshold_lines["hit"].value() == pytest.approx(50.0)
    panel.alert_controls["enabled"].setChecked(False)
    assert not panel.alerts.isVisibleTo(win)
    assert not win.timelines.threshold_lines["gpu"].isVisible()


def test_legend_keeps_its_lines_when_the_window_shrinks(replay_window, qapp):  # noqa: ANN001
    """A wide window made narrow (the splitters keep their old split): the legends ask
    for the height of their lines, so the views shrink below them instead."""
    win = replay_window
    win.replay.seek_step(150)
    for size in ((2400, 1300), (1000, 900), (760, 700)):
        win.resize(*size)
        for _ in range(3):
            qapp.processEvents()
        for view in (win.block_map, win.timelines):
            rects = [_rect(lab) for lab in view.legend.labels if lab.isVisible()]
            assert len(rects) == len(view.legend.labels)
            assert max(r.bottom() for r in rects) < _rect(view.canvas).top(), size


def test_highlight_over_a_selection_redraws_the_map(qtbot, qapp):  # noqa: ANN001
    """A prefix-tree highlight set while a sequence is selected lights the highlighted
    blocks, not the sequence's (the map must not keep the selection's frame)."""
    from kvscope.inspector import palette as P

    model = InspectorModel()
    view = BlockMapView(model)
    qtbot.addWidget(view)
    model.set_state(_pool(64))
    model.select_seq("a")
    cells = view.cells("gpu")
    assert cells[0] < P.DIM_OFFSET and cells[5] >= P.DIM_OFFSET  # a's block bright
    model.set_highlight({"gpu": [5]})
    cells = view.cells("gpu")
    assert cells[5] < P.DIM_OFFSET and cells[0] >= P.DIM_OFFSET
    model.set_highlight(None)
    assert view.cells("gpu")[0] < P.DIM_OFFSET
