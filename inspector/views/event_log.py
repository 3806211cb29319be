"""Event log: the latest events (newest at the bottom), filterable by kind and sequence.

While the user has scrolled up the log is *paused*: new events are counted, not shown,
so the rows being read do not move; scrolling back to the bottom resumes."""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QAbstractTableModel, QModelIndex, QPersistentModelIndex, Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QComboBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QTableView,
    QVBoxLayout,
    QWidget,
)

from kvscope.engine.events import schema as S
from kvscope.inspector import palette as P
from kvscope.inspector.model import InspectorModel

MAX_ROWS = 5000
COLUMNS = ("step", "kind", "seq", "tier", "details")
KIND_COLOURS = {
    S.ALLOC: P.USED, S.HIT: P.CACHED, S.STORE: P.CACHED, S.EVICT: P.SERIES["evict"],
    S.FREE: P.TEXT_DIM, S.FORK: P.SHARED, S.COW: P.SHARED, S.SEQ_PREEMPT: P.ERROR,
    S.SWAP_OUT: P.SWAPPED, S.SWAP_IN: P.SWAPPED, S.OFFLOAD: P.OFFLOADED,
    S.HOST_HIT: P.OFFLOADED, S.SEQ_FINISH: P.TEXT_DIM,
}
_Index = QModelIndex | QPersistentModelIndex


def _ids(v: Any) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(map(str, v[:12])) + (f", … +{len(v) - 12}]" if len(v) > 12
                                                     else "]")
    return str(v)


def event_row(step: int, ev: dict[str, Any]) -> tuple[int, str, str, str, str]:
    """(step, kind, seq, tier, details) as the log shows one event."""
    kind = str(ev.get("kind", "?"))
    seq = ev.get("seq")
    if seq is None and "seqs" in ev:
        seq = ",".join(map(str, ev["seqs"][:6]))
    skip = {"kind", "seq", "tier", "seqs"} if kind != S.SEQ_TOKENS else {"kind", "tier"}
    details = " ".join(f"{k}={_ids(v)}" for k, v in ev.items() if k not in skip)
    return step, kind, "" if seq is None else str(seq), str(ev.get("tier", "")), details


class EventLogModel(QAbstractTableModel):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, str, str, str, str]] = []

    def rowCount(self, parent: _Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent: _Index = QModelIndex()) -> int:  # noqa: B008
        return len(COLUMNS)

    def data(self, index: _Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        row = self.rows[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return str(row[index.column()])
        if role == Qt.ItemDataRole.ForegroundRole and index.column() == 1:
            return QColor(KIND_COLOURS.get(row[1], P.TEXT))
        return None

    def headerData(self, section: int, orientation: Qt.Orientation,
                   role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if role == Qt.ItemDataRole.DisplayRole and orientation == Qt.Orientation.Horizontal:
            return COLUMNS[section]
        return None

    def reset(self, rows: list[tuple[int, str, str, str, str]]) -> None:
        self.beginResetModel()
        self.rows = rows[-MAX_ROWS:]
        self.endResetModel()

    def append(self, rows: list[tuple[int, str, str, str, str]]) -> None:
        if len(self.rows) + len(rows) > MAX_ROWS:
            self.reset(self.rows + rows)
            return
        self.beginInsertRows(QModelIndex(), len(self.rows), len(self.rows) + len(rows) - 1)
        self.rows.extend(rows)
        self.endInsertRows()


class EventLogView(QWidget):
    def __init__(self, model: InspectorModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self.pending = 0  # events that arrived while paused
        self._stale = False  # rebuild deferred while the tab is hidden (see rebuild)
        self.kind = QComboBox()
        self.kind.addItems(["all kinds", *S.EVENT_KINDS])
        self.seq = QLineEdit()
        self.seq.setPlaceholderText("sequence id…")
        self.seq.setClearButtonEnabled(True)
        self.status = QLabel("")
        self.status.setStyleSheet(f"color: {P.WARN};")
        self.log_model = EventLogModel()
        self.table = QTableView()
        self.table.setModel(self.log_model)
        self.table.verticalHeader().hide()
        self.table.verticalHeader().setDefaultSectionSize(18)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setAlternatingRowColors(True)
        # Fixed widths: ResizeToContents measures every row on each reset (0.5 s at 5k rows).
        h = self.table.horizontalHeader()
        for c, width in enumerate((60, 90, 90, 44)):
            h.setSectionResizeMode(c, QHeaderView.ResizeMode.Interactive)
            h.resizeSection(c, width)
        h.setStretchLastSection(True)
        self.table.setStyleSheet("font-family: monospace; font-size: 9pt;")

        bar = QHBoxLayout()
        bar.addWidget(self.kind)
        bar.addWidget(self.seq, 1)
        bar.addWidget(self.status)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addLayout(bar)
        lay.addWidget(self.table)

        self.kind.currentIndexChanged.connect(self.rebuild)
        self.seq.textChanged.connect(self.rebuild)
        self.table.verticalScrollBar().valueChanged.connect(self._on_scroll)
        model.events_added.connect(self._on_events)
        model.events_reset.connect(self.rebuild)

    @property
    def paused(self) -> bool:
        sb = self.table.verticalScrollBar()
        return sb.maximum() > 0 and sb.value() < sb.maximum()

    def _match(self, row: tuple[int, str, str, str, str]) -> bool:
        kind = self.kind.currentText()
        if self.kind.currentIndex() > 0 and row[1] != kind:
            return False
        want = self.seq.text().strip()
        return not want or want in row[2].split(",")

    def rebuild(self) -> None:
        if not self.isVisible() and self.window().isVisible():
            # a hidden tab of a shown window (a seek resets the log each time): rebuild
            # when the tab is shown, not on every seek
            self._stale = True
            return
        self._stale = False
        rows = [event_row(step, ev) for step, ev in self.model.events]
        self.log_model.reset([r for r in rows if self._match(r)])
        self.pending = 0
        self.status.setText("")
        self.table.scrollToBottom()

    def showEvent(self, event: Any) -> None:  # noqa: N802 (Qt)
        super().showEvent(event)
        if self._stale:
            self.rebuild()

    def _on_events(self, new: list[tuple[int, dict[str, Any]]]) -> None:
        if self._stale:
            return  # the rebuild when the tab is shown includes these
        if self.paused:
            self.pending += len(new)
            self.status.setText(f"paused · {self.pending:,} new")
            return
        rows = [r for r in (event_row(s, e) for s, e in new) if self._match(r)]
        if rows:
            self.log_model.append(rows)
            self.table.scrollToBottom()

    def _on_scroll(self, value: int) -> None:
        if self.pending and value == self.table.verticalScrollBar().maximum():
            self.rebuild()
