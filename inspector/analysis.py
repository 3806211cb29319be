"""The analysis dock: lifecycle Gantt, range summary, two-moment compare and prefix tree,
all fed by one engine.events.analysis.lifecycle.LifecycleIndex (the recording's, computed once;
or the live one the model grows), plus threshold banners and the keyboard.

``install(window)`` adds the dock and the shortcuts to a MainWindow; the window calls
``on_replay(recording)`` / ``on_live()`` when a source opens. Keys: space play/pause (the
window's), left/right step, Home/End, ``g`` go to step, Ctrl-F find a request id, ``/``
filter the lifecycle rows, Esc clears the filter.
"""

from __future__ import annotations

import threading
from typing import Any

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QCheckBox,
    QDockWidget,
    QDoubleSpinBox,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QLineEdit,
    QScrollArea,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from kvscope.engine.events.analysis.lifecycle import PHASES, LifecycleIndex
from kvscope.engine.events.causes import describe
from kvscope.inspector import palette as P
from kvscope.inspector.thresholds import Thresholds
from kvscope.inspector.views.compare import CompareView
from kvscope.inspector.views.legend import Legend
from kvscope.inspector.views.lifecycle import PHASE_COLOURS, LifecycleView
from kvscope.inspector.views.prefix_tree import PrefixTreeView
from kvscope.inspector.views.range_summary import RangeSummaryView

LIVE_REFRESH_MS = 250  # the live index grows every tick; its views redraw at most this often
# Recordings longer than this get their index built on a worker thread (its own Recording
# handle), so opening a long replay is not held up (~10 us per event on this box).
BACKGROUND_INDEX_STEPS = 2000
TAB_LIFECYCLE, TAB_RANGE, TAB_COMPARE, TAB_PREFIXES, TAB_ALERTS = range(5)
DOCK_HEIGHT = 270  # px at start: the block map and the timelines keep most of the window


class AnalysisPanel(QWidget):
    index_ready = Signal(object, object)  # (recording, LifecycleIndex or error text)

    def __init__(self, window: Any) -> None:
        super().__init__()
        self.window = window
        self.model = window.model
        self.index: LifecycleIndex | None = None
        self.thresholds = Thresholds()
        self.lifecycle = LifecycleView(self.model)
        self.range = RangeSummaryView()
        self.compare = CompareView()
        self.prefix = PrefixTreeView()
        self.alerts = QLabel()
        self.alerts.setObjectName("banner")
        self.alerts.setStyleSheet(f"color: {P.WARN}; font-weight: bold;")
        self.alerts.hide()

        self.search = QLineEdit()
        self.search.setPlaceholderText("filter rows by id  (/ filter · Ctrl-F find)")
        self.search.setClearButtonEnabled(True)
        self.search.textChanged.connect(self.lifecycle.set_filter)
        self.search.returnPressed.connect(lambda: self.lifecycle.find(self.search.text()))
        legend = Legend()  # flows onto a second line when narrow, never over the rows
        legend.set_entries([(PHASE_COLOURS[k], "■", k, "") for k in PHASES]
                           + [(P.TEXT, "▲", "preemption", ""),
                              (P.TEXT_DIM, "▬", "light strip: blocks held", ""),
                              (P.SERIES["prefetch"], "▬", "disk prefetch", ""),
                              (P.SERIES["arrived"], "●", "arrived", ""),
                              (P.SERIES["missed"], "✕", "gave up: recomputed", "")])
        self.phase_legend = legend
        head = QHBoxLayout()
        head.addWidget(self.search, 1)
        head.addWidget(legend, 1)
        life = QWidget()
        lay = QVBoxLayout(life)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(head)
        lay.addWidget(self.lifecycle, 1)

        self.tabs = QTabWidget()
        self.tabs.addTab(life, "Lifecycle")
        # Tall pages scroll rather than make the whole dock (and the window) taller.
        self.tabs.addTab(_scrolling(self.range), "Range summary")
        self.tabs.addTab(_scrolling(self.compare), "Compare")
        self.tabs.addTab(self.prefix, "Prefixes")
        self.tabs.addTab(_scrolling(self._threshold_panel()), "Alerts")
        outer = QVBoxLayout(self)
        outer.setContentsMargins(2, 2, 2, 2)
        outer.addWidget(self.tabs, 1)
        central = getattr(window, "_central", None)  # the alert banner: above the block map
        if central is not None:
            central.insertWidget(1, self.alerts)
        else:
            outer.insertWidget(0, self.alerts)

        self.lifecycle.canvas.row_clicked.connect(self._row_clicked)
        self.lifecycle.canvas.range_selected.connect(self._range_selected)
        self.compare.pin_requested.connect(self._pin)
        self.prefix.blocks_selected.connect(self._highlight_prefix)
        self.model.cursor_changed.connect(self._on_cursor)
        self.index_ready.connect(self._on_index_ready)
        self._live_timer = QTimer(self)
        self._live_timer.setInterval(LIVE_REFRESH_MS)
        self._live_timer.timeout.connect(self._refresh_live)

    # --------------------------------------------------------------- sources
    def set_index(self, index: LifecycleIndex) -> None:
        self.index = index
        self.lifecycle.set_index(index)
        self.range.set_index(index)
        self.prefix.set_index(index)
        self._draw_costs()

    def _draw_costs(self) -> None:
        """The index's cost series on the main window's timelines."""
        timelines = getattr(self.window, "timelines", None)
        if timelines is not None and self.index is not None:
            timelines.set_costs(self.index)

    def show_tab(self, tab: int) -> None:
        """Bring one of the TAB_* pages to the front."""
        self.tabs.setCurrentIndex(tab)

    def on_replay(self, recording: Any) -> None:
        path = getattr(recording, "path", None)
        steps = len(getattr(recording, "steps", ()))
        if path is None or steps <= BACKGROUND_INDEX_STEPS:
            self.set_index(LifecycleIndex.for_recording(recording))
            return
        self.lifecycle.canvas.message = f"building the lifecycle index of {steps:,} steps…"
        self.lifecycle.canvas.update()

        def build() -> None:
            from kvscope.engine.events.wire.recording import Recording, RecordingError

            try:
                with Recording(path) as own:  # a Recording is not shared across threads
                    result: Any = LifecycleIndex.from_batches(own.batches())
            except (RecordingError, OSError) as e:
                result = f"lifecycle index: {e}"
            try:
                self.index_ready.emit(recording, result)
            except RuntimeError:  # the window was closed meanwhile
                pass

        self._builder = threading.Thread(target=build, name="kvscope-lifecycle", daemon=True)
        self._builder.start()

    def _on_index_ready(self, recording: Any, result: Any) -> None:
        if getattr(self.window, "replay", None) is None or \
                self.window.replay.recording is not recording:
            return  # another recording was opened meanwhile
        if isinstance(result, str):
            self.window.show_error(result)
            return
        LifecycleIndex.remember(recording, result)
        self.set_index(result)

    def on_live(self) -> None:
        self.set_index(self.model.lifecycle)
        self._live_timer.start()

    def _refresh_live(self) -> None:
        if self.model.lifecycle is not self.index:  # a restarted engine: a fresh index
            self.set_index(self.model.lifecycle)
        self.lifecycle.refresh()
        self._draw_costs()
        if self.tabs.currentIndex() == TAB_PREFIXES:
            self.prefix.refresh()

    # ---------------------------------------------------------- interactions
    def _row_clicked(self, sid: str) -> None:
        """Select the sequence everywhere; in replay, seek to where it holds blocks when
        the step shown is outside its life."""
        w = self.window
        if sid not in self.model.state.seqs and w.replay is not None and self.index:
            s = self.index.seqs[sid]
            if s.blocks:
                step = max(s.blocks, key=lambda sb: sb[1])[0]  # most blocks held
                w.replay.pause()
                w.replay.seek_step(step)
        self.model.highlight = None  # a prefix highlight gives way to the selection
        self.model.select_seq(sid)
        seqs = getattr(w, "sequences", None)
        if seqs is not None and hasattr(w, "right_tabs"):
            w.right_tabs.setCurrentWidget(seqs)

    def _range_selected(self, a: int, b: int) -> None:
        self.range.set_range(a, b)
        self.show_tab(TAB_RANGE)

    def _pin(self, name: str) -> None:
        st = self.model.state
        label = f"step {st.step}"
        self.compare.set_moment(name, st.clone(), label)

    def _highlight_prefix(self, _blocks: dict) -> None:
        """Highlight the selected prefix node's blocks as they are at the step shown."""
        hashes = self.prefix.selected_hashes()
        if not hashes or self.index is None:
            self.model.set_highlight(None)
            return
        canon = self.model.state.canonical()["tiers"]
        self.model.set_highlight({t: [b for b, h in enumerate(v["hash"]) if h in hashes]
                                  for t, v in canon.items()})

    def _on_cursor(self, step: int) -> None:
        t = self.thresholds
        timelines = getattr(self.window, "timelines", None)
        if timelines is not None:
            timelines.set_thresholds(t.max_utilization if t.enabled else None,
                                     t.min_hit_rate if t.enabled else None)
        if self.index is None:
            return
        alerts = t.check(self.index, step)
        self.alerts.setText("⚠  " + " · ".join(alerts) if alerts else "")
        self.alerts.setVisible(bool(alerts))

    def _threshold_panel(self) -> QWidget:
        w = QWidget()
        lay = QVBoxLayout(w)
        on = QCheckBox("Show alert banners (off by default)")
        lay.addWidget(on)
        self.alert_controls: dict[str, Any] = {"enabled": on}
        t = self.thresholds

        def spin(label: str, value: float, lo: float, hi: float, step: float, attr: str,
                 scale: float = 1.0) -> None:
            box = QDoubleSpinBox()
            box.setRange(lo, hi)
            box.setSingleStep(step)
            box.setValue(value * scale)
            box.valueChanged.connect(lambda v: (setattr(t, attr, v / scale),
                                                self._on_cursor(self.model.state.step)))
            self.alert_controls[attr] = box
            row = QHBoxLayout()
            row.addWidget(QLabel(label))
            row.addWidget(box)
            row.addStretch(1)
            lay.addLayout(row)

        spin("utilization above (%)", t.max_utilization, 0, 100, 1, "max_utilization", 100)
        spin("prefix hit rate below (%)", t.min_hit_rate, 0, 100, 1, "min_hit_rate", 100)
        spin("evictions per second above", t.max_evictions_per_s, 0, 1e9, 10,
             "max_evictions_per_s")
        lay.addStretch(1)
        on.toggled.connect(lambda v: (setattr(t, "enabled", v),
                                      self._on_cursor(self.model.state.step)))
        return w

    def marker_tip(self, kind: str, step: int) -> str:
        """The causes behind a timeline marker: preemptions or evictions at ``step``."""
        idx = self.index
        if idx is None:
            return ""
        if kind == "preempt":
            lines = [f"step {p.step}: {sid} preempted ({p.mode}): "
                     f"{describe(p.cause, victim=sid)}"
                     for sid, p in idx.preemptions if p.step == step]
        else:
            lines = [f"step {e['step']}: evicted {e['blocks']} {e['tier']} block(s): "
                     f"{describe(e['cause'], 'evict')}" for e in idx.evictions
                     if e["step"] == step]
        return "\n".join(lines[:10]) or f"step {step}"

    # -------------------------------------------------------------- keyboard
    def go_to_step(self) -> None:
        w = self.window
        if w.replay is None or not w.replay.num_steps:
            return
        step, ok = QInputDialog.getInt(w, "Go to step", "step:", w.replay.step,
                                       int(w.replay.steps[0]), int(w.replay.steps[-1]))
        if ok:
            w.replay.pause()
            w.replay.seek_step(step)

    def focus_search(self, find: bool) -> None:
        self.tabs.setCurrentIndex(0)
        self.search.setFocus()
        self.search.selectAll()
        self.search.setPlaceholderText("find a request id, Enter selects it" if find
                                       else "filter rows by id")


def _scrolling(page: QWidget) -> QScrollArea:
    area = QScrollArea()
    area.setWidgetResizable(True)
    area.setFrameShape(QScrollArea.Shape.NoFrame)
    area.setWidget(page)
    return area


def _marker_tooltips(window: Any, panel: AnalysisPanel) -> None:
    """Hovering a preemption or eviction marker on the window's timelines shows its causes
    (pyqtgraph scatter tooltips; skipped if the timelines have no such markers)."""
    curves = getattr(getattr(window, "timelines", None), "curves", {})
    for name, curve in curves.items():
        kind = name.rsplit("_", 1)[-1]
        scatter = getattr(curve, "scatter", None)
        if kind not in ("preempt", "evict") or scatter is None:
            continue
        scatter.opts["hoverable"] = True
        scatter.opts["tip"] = lambda x, y, data, k=kind: panel.marker_tip(k, int(round(x)))
        scatter.setAcceptHoverEvents(True)


def install(window: Any) -> AnalysisPanel:
    panel = AnalysisPanel(window)
    dock = QDockWidget("Analysis", window)
    dock.setObjectName("analysis")
    dock.setWidget(panel)
    dock.setFeatures(QDockWidget.DockWidgetFeature.DockWidgetMovable
                     | QDockWidget.DockWidgetFeature.DockWidgetFloatable)
    window.addDockWidget(Qt.DockWidgetArea.BottomDockWidgetArea, dock)
    window.resizeDocks([dock], [DOCK_HEIGHT], Qt.Orientation.Vertical)
    # The dock takes height from the block map and the timelines: give the timelines
    # (several stacked plots whose axis titles collide when short) the larger part.
    split = getattr(window, "timelines", None) and window.timelines.parentWidget()
    if isinstance(split, QSplitter) and split.count() == 2:
        split.setSizes([320, 580])
    _marker_tooltips(window, panel)

    def key(seq: Any, fn: Any) -> None:
        a = QAction(window)
        a.setShortcut(QKeySequence(seq))
        a.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
        a.triggered.connect(fn)
        window.addAction(a)

    def replay(fn_name: str) -> Any:
        return lambda: getattr(window.replay, fn_name)() if window.replay else None

    key(Qt.Key.Key_Right, replay("step_forward"))
    key(Qt.Key.Key_Left, replay("step_back"))
    key(Qt.Key.Key_Home, replay("to_start"))
    key(Qt.Key.Key_End, replay("to_end"))
    key("G", panel.go_to_step)
    key("Ctrl+F", lambda: panel.focus_search(True))
    key("/", lambda: panel.focus_search(False))
    key(Qt.Key.Key_Escape, lambda: panel.search.clear())
    return panel
