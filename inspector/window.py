"""MainWindow: the block map, sequences, timelines and event log around one
InspectorModel, a replay bar or live status, an error banner and export actions.

Errors (unreadable recording, wrong endpoint, protocol mismatch) show in the banner and
the status bar; nothing here raises into Qt's event loop.
"""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QFileDialog,
    QLabel,
    QMainWindow,
    QSplitter,
    QStatusBar,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from kvscope.inspector import analysis
from kvscope.inspector.model import InspectorModel
from kvscope.inspector.sources.replay import ReplayController
from kvscope.inspector.views.block_map import MODES, BlockMapView
from kvscope.inspector.views.event_log import EventLogView
from kvscope.inspector.views.replay_bar import ReplayBar
from kvscope.inspector.views.sequences import SequencesView
from kvscope.inspector.views.timelines import TimelinesView

STATUS_FIELDS = ("source", "epoch", "seq", "loss", "rate", "position")


class MainWindow(QMainWindow):
    def __init__(self) -> None:
        super().__init__()
        self.model = InspectorModel()
        self.replay: ReplayController | None = None
        self.live: Any = None
        self.replay_bar: ReplayBar | None = None
        self.setWindowTitle("kvscope inspector")
        self.resize(1600, 1000)

        self.banner = QLabel()
        self.banner.setObjectName("banner")
        self.banner.setWordWrap(True)
        self.banner.hide()
        # which engine the stream comes from, when it is not kvscope's own (engine_line)
        self.engine_banner = QLabel()
        self.engine_banner.setObjectName("engine_banner")
        self.engine_banner.setWordWrap(True)
        self.engine_banner.hide()
        self.block_map = BlockMapView(self.model)
        self.timelines = TimelinesView(self.model)
        self.sequences = SequencesView(self.model)
        self.event_log = EventLogView(self.model)
        self.timelines.seek_requested.connect(self._seek_from_timeline)

        left = QSplitter(Qt.Orientation.Vertical)
        left.addWidget(self.block_map)
        left.addWidget(self.timelines)
        left.setSizes([560, 400])
        right = QTabWidget()
        right.addTab(self.sequences, "Sequences")
        right.addTab(self.event_log, "Event log")
        self.right_tabs = right
        main = QSplitter(Qt.Orientation.Horizontal)
        main.addWidget(left)
        main.addWidget(right)
        main.setSizes([1000, 600])
        central = QWidget()
        self._central = QVBoxLayout(central)
        self._central.setContentsMargins(4, 4, 4, 4)
        self._central.addWidget(self.banner)
        self._central.addWidget(self.engine_banner)
        self._central.addWidget(main, 1)
        self.setCentralWidget(central)

        self.status = QStatusBar()
        self.status.setSizeGripEnabled(False)
        self.setStatusBar(self.status)
        self.status_labels: dict[str, QLabel] = {}
        for name in STATUS_FIELDS:
            lab = QLabel("")
            self.status_labels[name] = lab
            self.status.addPermanentWidget(lab)
        self._build_menu()
        self.model.cursor_changed.connect(self._on_cursor)
        self.analysis = analysis.install(self)  # lifecycle, range, compare, prefixes

    # --------------------------------------------------------------- sources
    def open_replay(self, recording: Any, label: str) -> None:
        """Show a recording (anything with steps/state_at/batches), at its first step."""
        self.replay = ReplayController(recording, self.model)
        self.replay.error.connect(self.show_error)
        self.replay_bar = ReplayBar(self.replay)
        self._central.addWidget(self.replay_bar)
        self.setWindowTitle(f"kvscope inspector — {label}")
        self.show_engine(getattr(recording, "header", None))
        self.set_status(source=f"<b>replay</b> {label}",
                        epoch=f"epoch {self.replay.epoch or '—'}",
                        rate=f"{self.replay.num_steps:,} steps")
        self.analysis.on_replay(recording)
        if self.replay.num_steps:
            self.replay.seek_index(0)
        else:
            self.show_error(f"{label}: the recording holds no steps")

    def attach_live(self, live: Any, label: str) -> None:
        """Show a LiveSource: its status in the status bar, its problems in the banner."""
        self.live = live
        self.timelines.follow.setChecked(True)
        self.setWindowTitle(f"kvscope inspector — live {label}")
        live.status_changed.connect(lambda fields: self.set_status(**fields))
        live.problem.connect(lambda text: self.show_error(text) if text else self.clear_error())
        live.engine_info.connect(self.show_engine)
        self.set_status(**live.status_fields())
        self.analysis.on_live()

    # ------------------------------------------------------------ reporting
    def show_engine(self, header: Any) -> None:
        """Say which engine is watched when it is not kvscope's own (e.g. vLLM)."""
        text = engine_line(header)
        self.engine_banner.setText(text)
        self.engine_banner.setVisible(bool(text))

    def show_error(self, text: str) -> None:
        """A clear message in the banner and status bar; the window keeps working."""
        self.banner.setText(f"⚠  {text}")
        self.banner.show()
        self.status.showMessage(text)

    def clear_error(self) -> None:
        self.banner.hide()
        self.status.clearMessage()

    def set_status(self, **fields: str) -> None:
        for name, text in fields.items():
            self.status_labels[name].setText(text)

    def _on_cursor(self, step: int) -> None:
        if self.replay is not None:
            self.set_status(position=f"step {self.replay.step:,} · +{self.replay.elapsed():.2f} s")

    def _seek_from_timeline(self, step: int) -> None:
        if self.replay is not None:
            self.replay.pause()
            self.replay.seek_step(step)

    # ---------------------------------------------------------------- export
    def _build_menu(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        view_menu = self.menuBar().addMenu("&View")

        def action(menu: Any, text: str, slot: Any, shortcut: str | None = None) -> QAction:
            a = QAction(text, self)
            a.triggered.connect(slot)
            if shortcut:
                a.setShortcut(QKeySequence(shortcut))
            menu.addAction(a)
            return a

        action(file_menu, "Export window as PNG…", lambda: self._ask_png(self), "Ctrl+E")
        action(file_menu, "Export block map as PNG…", lambda: self._ask_png(self.block_map))
        action(file_menu, "Export timelines as PNG…", lambda: self._ask_png(self.timelines))
        action(file_menu, "Export timelines as CSV…", self._ask_csv)
        file_menu.addSeparator()
        action(file_menu, "Quit", self.close, "Ctrl+Q")
        colour_menu = view_menu.addMenu("Colour blocks by")  # mirrors the map's combo
        for i, mode in enumerate(MODES):
            a = action(colour_menu, mode, lambda _=False, m=mode: self.block_map.set_mode(m),
                       f"Alt+{i + 1}")
            a.setCheckable(True)
            a.setChecked(mode == self.block_map.mode)
            self.block_map.colour_by.currentTextChanged.connect(
                lambda cur, a=a, m=mode: a.setChecked(cur == m))
        play = QAction("Play / pause", self)
        play.setShortcut(QKeySequence(Qt.Key.Key_Space))
        play.triggered.connect(lambda: self.replay.toggle() if self.replay else None)
        self.addAction(play)

    def export_png(self, path: str | Path, widget: QWidget | None = None) -> None:
        """Save a PNG of the window (default) or one of its views."""
        if not (widget or self).grab().save(str(path), "PNG"):
            raise OSError(f"could not write PNG {path}")

    def export_csv(self, path: str | Path) -> None:
        self.model.timeline.write_csv(path)

    def _ask_png(self, widget: QWidget) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export PNG", "kvscope.png", "PNG (*.png)")
        if path:
            self._guarded(lambda: self.export_png(path, widget))

    def _ask_csv(self) -> None:
        path, _ = QFileDialog.getSaveFileName(self, "Export CSV", "timelines.csv", "CSV (*.csv)")
        if path:
            self._guarded(lambda: self.export_csv(path))

    def _guarded(self, fn: Any) -> None:
        try:
            fn()
        except OSError as e:
            self.show_error(str(e))


def engine_line(header: Any) -> str:
    """One line naming a foreign engine from a stream's or recording's header (its
    ``engine`` map: name, version, geometry, what it cannot see), "" for kvscope's own
    engine or a header without one. Untrusted input: only strings and ints are shown."""
    engine = header.get("engine") if isinstance(header, dict) else None
    if not isinstance(engine, dict) or engine.get("name") != "vllm":
        return ""

    def txt(v: Any) -> str:
        return escape(str(v)) if isinstance(v, (str, int)) and not isinstance(v, bool) else "?"

    model = header.get("model")
    parts = [f"<b>watching vLLM {txt(engine.get('version'))}</b>"]
    if isinstance(model, str):
        parts.append(txt(model))
    parts.append(f"{txt(engine.get('num_blocks'))} blocks x {txt(engine.get('block_size'))} "
                 "tokens (block 0: vLLM's null block)")
    rank = engine.get("data_parallel_rank")
    if isinstance(rank, int) and rank:
        parts.append(f"data-parallel rank {rank}")
    unseen = engine.get("unseen")
    if isinstance(unseen, list) and unseen:
        parts.append("not seen: " + "; ".join(txt(u) for u in unseen[:4]))
    return " · ".join(parts)
