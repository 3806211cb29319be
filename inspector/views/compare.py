"""Two moments side by side: pin A and B (steps of the open recording, or a step of
another recording for B: ``load_other``), see both block maps with every block that
differs outlined, and a table of what changed (engine.events.analysis.ranges.diff_states).

``CodeGrid`` draws one tier's block codes: cells with borders and block ids when they
are big enough to read (small pools), a scaled image otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from PySide6.QtCore import QRectF, Qt, Signal
from PySide6.QtGui import QColor, QFont, QImage, QPainter, QPen
from PySide6.QtWidgets import (
    QFileDialog,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from kvscope.engine.events import KVState
from kvscope.engine.events import schema as S
from kvscope.engine.events.analysis.ranges import diff_states
from kvscope.engine.events.wire.recording import RecordingError
from kvscope.inspector import palette as P
from kvscope.inspector.views.block_map import grid_width

STATE_COLOURS = (P.FREE, P.CACHED, P.USED, P.SHARED)
MIN_ID_CELL = 22  # px: cells at least this big show their block id


class CodeGrid(QWidget):
    """One tier's blocks (schema.BLOCK_* codes); ``marked`` blocks get a bright outline."""

    def __init__(self, title: str = "") -> None:
        super().__init__()
        self.title = title
        self.codes = np.zeros(0, dtype=np.uint8)
        self.marked = np.zeros(0, dtype=np.int64)
        self.setMinimumSize(220, 160)
        self._lut = [QColor(c).rgb() for c in STATE_COLOURS] + [QColor(P.PANEL).rgb()] * 252

    def set_codes(self, codes: np.ndarray, marked: Any = (), title: str | None = None) -> None:
        self.codes = np.asarray(codes, dtype=np.uint8)
        self.marked = np.asarray(list(marked), dtype=np.int64)
        if title is not None:
            self.title = title
        self.update()

    def _cell(self) -> tuple[int, float]:
        n = max(1, self.codes.size)
        w = grid_width(n)
        rows = -(-n // w)
        cell = min((self.width() - 4) / w, (self.height() - 22) / max(1, rows))
        return w, max(1.0, cell)

    def paintEvent(self, _e) -> None:  # noqa: N802 (Qt)
        p = QPainter(self)
        p.fillRect(self.rect(), QColor(P.PANEL))
        p.setPen(QColor(P.TEXT))
        p.drawText(QRectF(4, 0, self.width() - 8, 18), Qt.AlignmentFlag.AlignVCenter,
                   self.title)
        n = self.codes.size
        if not n:
            p.end()
            return
        w, cell = self._cell()
        rows = -(-n // w)
        if cell >= 6:  # readable: cells with borders (and ids when big enough)
            font = QFont(self.font())
            font.setPointSize(7)
            p.setFont(font)
            for b in range(n):
                r, c = divmod(b, w)
                rect = QRectF(2 + c * cell, 20 + r * cell, cell - 1, cell - 1)
                p.fillRect(rect, QColor(STATE_COLOURS[min(3, int(self.codes[b]))]))
                if cell >= MIN_ID_CELL:
                    p.setPen(QColor(P.BG))
                    p.drawText(rect, Qt.AlignmentFlag.AlignCenter, str(b))
        else:  # many blocks: one image, scaled
            padded = np.full(rows * w, 4, dtype=np.uint8)
            padded[:n] = self.codes
            data = padded.tobytes()  # QImage borrows this buffer: keep it alive while drawing
            img = QImage(data, w, rows, w, QImage.Format.Format_Indexed8)
            img.setColorTable(self._lut)
            p.drawImage(QRectF(2, 20, w * cell, rows * cell), img)
        pen = QPen(QColor(P.SELECTED))
        pen.setWidthF(max(1.0, min(2.0, cell / 6)))
        p.setPen(pen)
        p.setBrush(Qt.BrushStyle.NoBrush)
        for b in self.marked.tolist():
            r, c = divmod(b, w)
            p.drawRect(QRectF(2 + c * cell, 20 + r * cell, max(1.0, cell - 1),
                              max(1.0, cell - 1)))
        p.end()


class CompareView(QWidget):
    """Pin A / Pin B take the step shown now; ``compare(a, b)`` fills maps and table."""

    pin_requested = Signal(str)  # "A" or "B": the window answers with set_moment

    def __init__(self) -> None:
        super().__init__()
        self.states: dict[str, KVState | None] = {"A": None, "B": None}
        self.labels: dict[str, str] = {"A": "", "B": ""}
        self.grid_a, self.grid_b = CodeGrid("A"), CodeGrid("B")
        self.summary = QLabel("Pin two moments: the step shown now becomes A or B.")
        self.summary.setWordWrap(True)
        self.table = QTableWidget(0, 3)
        self.table.setHorizontalHeaderLabels(["what", "count", "ids"])
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.verticalHeader().hide()
        buttons = QHBoxLayout()
        for name in ("A", "B"):
            b = QPushButton(f"Pin {name} = step shown")
            b.clicked.connect(lambda _=False, n=name: self.pin_requested.emit(n))
            buttons.addWidget(b)
        other = QPushButton("B from another recording…")
        other.clicked.connect(self._ask_other)
        buttons.addWidget(other)
        buttons.addStretch(1)
        maps = QHBoxLayout()
        maps.addWidget(self.grid_a, 1)
        maps.addWidget(self.grid_b, 1)
        lay = QVBoxLayout(self)
        lay.addLayout(buttons)
        lay.addLayout(maps, 3)
        lay.addWidget(self.summary)
        lay.addWidget(self.table, 2)
        self.diff: dict[str, Any] | None = None

    def load_other(self, path: str, step: int | None = None) -> None:
        """Moment B from another recording (its last step unless ``step``)."""
        from kvscope.engine.events.wire.recording import Recording

        with Recording(path) as rec:
            if not rec.steps:
                raise RecordingError(f"{path}: the recording holds no steps")
            at = rec.steps[-1] if step is None else step
            self.set_moment("B", rec.state_at(at), f"{Path(path).name} step {at}")

    def _ask_other(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Recording for B", "",
                                              "kvscope recordings (*.kvtrace);;all (*)")
        if not path:
            return
        step, ok = QInputDialog.getInt(self, "Step of B", "step (-1: the last):", -1, -1,
                                       1 << 30)
        if not ok:
            return
        try:
            self.load_other(path, None if step < 0 else step)
        except (RecordingError, OSError) as e:
            self.summary.setText(f"⚠  {e}")

    def set_moment(self, name: str, state: KVState, label: str) -> None:
        self.states[name] = state
        self.labels[name] = label
        codes = state.block_codes("gpu") if "gpu" in state.tiers else np.zeros(0)
        (self.grid_a if name == "A" else self.grid_b).set_codes(codes, title=f"{name}: {label}")
        if self.states["A"] is not None and self.states["B"] is not None:
            self._compare()

    def _compare(self) -> None:
        a, b = self.states["A"], self.states["B"]
        d = diff_states(a, b)
        self.diff = d
        g = d["tiers"].get("gpu", {})
        marked = g.get("changed", [])
        self.grid_a.set_codes(a.block_codes("gpu"), marked, f"A: {self.labels['A']}")
        self.grid_b.set_codes(b.block_codes("gpu"), marked, f"B: {self.labels['B']}")
        rows: list[tuple[str, list]] = []
        for tier, t in sorted(d["tiers"].items(), key=lambda kv: kv[0] != "gpu"):
            for key in ("allocated", "freed", "cached", "uncached"):
                rows.append((f"{tier} blocks {key}", t[key]))
        rows.append(("sequences that came", d["seqs_came"]))
        rows.append(("sequences that went", d["seqs_went"]))
        rows.append(("sequences whose table changed",
                     [f"{sid} {x}→{y}" for sid, (x, y) in d["seqs_changed"].items()]))
        self.table.setRowCount(len(rows))
        for r, (what, ids) in enumerate(rows):
            self.table.setItem(r, 0, QTableWidgetItem(what))
            self.table.setItem(r, 1, QTableWidgetItem(str(len(ids))))
            text = ", ".join(map(str, ids[:200])) + (" …" if len(ids) > 200 else "")
            item = QTableWidgetItem(text)
            item.setToolTip(text)
            self.table.setItem(r, 2, item)
        self.table.resizeColumnToContents(0)
        self.summary.setText(
            f"{len(marked)} gpu blocks differ (outlined) between A and B; "
            f"{len(d['seqs_came'])} sequences came, {len(d['seqs_went'])} went.")


def codes_legend() -> str:
    return " · ".join(f"<span style='color:{c}'>■</span> {n}"
                      for c, n in zip(STATE_COLOURS, S.BLOCK_STATE_NAMES, strict=True))
