"""Lifecycle Gantt: one row per sequence (arrival order), its phases along the step axis.

Virtualised: ``paintEvent`` draws only the rows in view (a row is a few rectangles), so
scrolling costs the same at 100 or 100k sequences. Each row shows its phases
(engine.events.analysis.lifecycle.PHASES) coloured, a light strip whose height follows its
block count,
prefix-hit marks, preemption markers (hover: the cause), its disk prefetches (a band over
the waiting phase from the reads' start to the last arrival, ending in a dot where they
all arrived or a cross where the sequence gave up waiting and recomputed the rest; hover:
blocks and wait), and at the end TTFT and TPOT.
A top lane marks evictions (hover: their causes). The cursor step is a vertical line.

Mouse: click a row selects its sequence everywhere (the model's selection); hover shows
details; shift-drag on the rows selects a step range (``range_selected``); wheel
scrolls, ctrl+wheel zooms the step axis. ``set_filter`` keeps the rows whose id contains
a text (the ``/`` key); ``find`` selects and scrolls to the first match (Ctrl-F).
"""

from __future__ import annotations

import bisect

import numpy as np
from PySide6.QtCore import QPoint, QRectF, Qt, Signal
from PySide6.QtGui import QColor, QFont, QFontMetrics, QPainter, QPen, QPolygonF
from PySide6.QtWidgets import QHBoxLayout, QScrollBar, QToolTip, QVBoxLayout, QWidget

from kvscope.engine.events.analysis import lifecycle as L
from kvscope.engine.events.causes import describe
from kvscope.inspector import palette as P

PHASE_COLOURS = {
    L.WAITING: P.WARN, L.PREFILL: P.ACCENT, L.RUNNING: P.USED, L.PREEMPTED: P.ERROR,
    L.SWAPPED: P.SWAPPED,
}
ROW_H = 16
LANE_H = 18  # the eviction lane at the top
LABEL_W = 150
TAIL_W = 240  # TTFT / TPOT text after the last step


def elide_middle(text: str, width: int, metrics: QFontMetrics) -> str:
    """``text`` cut in the middle to fit ``width`` pixels (ids keep their both ends)."""
    return metrics.elidedText(text, Qt.TextElideMode.ElideMiddle, width)


class GanttCanvas(QWidget):
    row_clicked = Signal(str)
    range_selected = Signal(int, int)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setMouseTracking(True)
        self.setMinimumHeight(120)
        self.index: L.LifecycleIndex | None = None
        self.rows: list[str] = []
        self.top = 0  # first row in view
        self.step0, self.step1 = 0, 1  # the step axis in view
        self.cursor_step: int | None = None
        self.selected: str | None = None
        self.range: tuple[int, int] | None = None
        self._drag_from: int | None = None
        self.font_small = QFont(self.font())
        self.font_small.setPointSize(8)
        self.metrics = QFontMetrics(self.font_small)
        self.message = "no lifecycle yet"  # shown while there is no index
        self._max_blocks = 1
        # eviction steps as an array, grown as the index grows: (index, count, steps)
        self._lane: tuple[object, int, np.ndarray] = (None, 0, np.zeros(0, dtype=np.int64))

    # ------------------------------------------------------------- geometry
    @property
    def visible_rows(self) -> int:
        return max(1, (self.height() - LANE_H) // ROW_H)

    def _x(self, step: float) -> float:
        w = max(1, self.width() - LABEL_W - TAIL_W)
        return LABEL_W + (step - self.step0) / max(1e-9, self.step1 - self.step0) * w

    def _step_at(self, x: float) -> int:
        w = max(1, self.width() - LABEL_W - TAIL_W)
        return int(round(self.step0 + (x - LABEL_W) / w * (self.step1 - self.step0)))

    def _row_at(self, y: float) -> int | None:
        if y < LANE_H:
            return None
        r = self.top + int((y - LANE_H) // ROW_H)
        return r if 0 <= r < len(self.rows) else None

    def fit_steps(self) -> None:
        idx = self.index
        if idx is None or not len(idx.steps["step"]):
            return
        self.step0 = int(idx.steps["step"][0])
        self.step1 = max(self.step0 + 1, int(idx.last_step) + 1)

    # -------------------------------------------------------------- drawing
    def paintEvent(self, _event) -> None:  # noqa: N802 (Qt)
        p = QPainter(self)
        p.fillRect(self.rect(), QColor(P.PANEL))
        p.setFont(self.font_small)
        idx = self.index
        if idx is None:
            p.setPen(QColor(P.TEXT_DIM))
            p.drawText(self.rect(), Qt.AlignmentFlag.AlignCenter, self.message)
            p.end()
            return
        end_step = idx.last_step + 1
        self._paint_lane(p, idx)
        if self.range is not None:
            a, b = sorted(self.range)
            p.fillRect(QRectF(self._x(a), 0, max(2.0, self._x(b + 1) - self._x(a)),
                              self.height()), QColor(90, 169, 230, 40))
        for i in range(self.top, min(len(self.rows), self.top + self.visible_rows + 1)):
            self._paint_row(p, idx, i, end_step)
        if self.cursor_step is not None:
            x = self._x(self.cursor_step + 0.5)
            p.setPen(QPen(QColor(P.SELECTED), 1))
            p.drawLine(int(x), 0, int(x), self.height())
        p.end()

    def _paint_lane(self, p: QPainter, idx: L.LifecycleIndex) -> None:
        p.fillRect(QRectF(0, 0, self.width(), LANE_H - 2), QColor(P.PANEL_2))
        p.setPen(QColor(P.TEXT_DIM))
        p.drawText(QRectF(4, 0, LABEL_W - 8, LANE_H - 2), Qt.AlignmentFlag.AlignVCenter,
                   "evictions")
        colour = QColor(P.SERIES["evict"])
        # One mark per pixel column, not per eviction: a long run holds 10^4-10^5 of
        # them and a rect per eviction made every repaint (each seek's) cost ~170 ms.
        steps = self._eviction_steps(idx)
        lo = int(np.searchsorted(steps, self.step0, side="left"))
        hi = int(np.searchsorted(steps, self.step1, side="right"))
        if hi <= lo:
            return
        w = max(1, self.width() - LABEL_W - TAIL_W)
        xs = LABEL_W + (steps[lo:hi] + 0.5 - self.step0) / max(1e-9, self.step1 - self.step0) * w
        for x in np.unique(np.round(xs * 2) / 2).tolist():
            p.fillRect(QRectF(x - 1.5, 3, 3, LANE_H - 8), colour)

    def _eviction_steps(self, idx: L.LifecycleIndex) -> np.ndarray:
        """The index's eviction steps (in step order) as an array, extended in place as
        a live index grows (a new index starts over)."""
        key, n, steps = self._lane
        evs = idx.evictions
        if key is not idx or n > len(evs):
            key, n, steps = idx, 0, np.zeros(0, dtype=np.int64)
        if n < len(evs):
            new = np.fromiter((e["step"] for e in evs[n:]), dtype=np.int64,
                              count=len(evs) - n)
            steps = np.concatenate((steps, new))
            self._lane = (key, len(evs), steps)
        return steps

    def _paint_row(self, p: QPainter, idx: L.LifecycleIndex, i: int, end_step: int) -> None:
        sid = self.rows[i]
        s = idx.seqs[sid]
        y = LANE_H + (i - self.top) * ROW_H
        if sid == self.selected:
            p.fillRect(QRectF(0, y, self.width(), ROW_H), QColor("#2f5d86"))
        elif i % 2:
            p.fillRect(QRectF(0, y, self.width(), ROW_H), QColor(P.PANEL_2))
        p.setPen(QColor(P.TEXT))
        p.drawText(QRectF(4, y, LABEL_W - 8, ROW_H), Qt.AlignmentFlag.AlignVCenter,
                   elide_middle(sid, LABEL_W - 8, self.metrics))
        for ph in s.phases:
            a = ph.start_step
            b = ph.end_step if ph.end_step is not None else end_step
            if b < self.step0 or a > self.step1:
                continue
            x0, x1 = self._x(a), self._x(b)
            p.fillRect(QRectF(x0, y + 2, max(1.0, x1 - x0), ROW_H - 4),
                       QColor(PHASE_COLOURS.get(ph.kind, P.TEXT_DIM)))
        self._paint_blocks(p, s, y, end_step)
        for pf in s.prefetches:
            self._paint_prefetch(p, pf, y, end_step)
        for pre in s.preemptions:
            x = self._x(pre.step)
            tri = QPolygonF([QPoint(int(x), int(y + 1)), QPoint(int(x - 4), int(y + 8)),
                             QPoint(int(x + 4), int(y + 8))])
            p.setBrush(QColor(P.SELECTED))
            p.setPen(Qt.PenStyle.NoPen)
            p.drawPolygon(tri)
        for step, _ in s.hits:
            x = self._x(step)
            p.fillRect(QRectF(x, y + ROW_H - 5, 2, 3), QColor(P.CACHED).lighter(150))
        last = s.finish_step + 1 if s.finish_step is not None else end_step
        p.setPen(QColor(P.TEXT_DIM))
        x = self._x(last) + 4
        p.drawText(QRectF(x, y, max(TAIL_W, self.width() - x), ROW_H),
                   Qt.AlignmentFlag.AlignVCenter, _tail(s))

    def _paint_prefetch(self, p: QPainter, pf: L.PrefetchSpan, y: int, end_step: int) -> None:
        """A band from the reads' start to their last arrival (or to now while in
        flight, or to where the wait was given up), then the outcome's mark."""
        if pf.outcome == L.ARRIVED and pf.arrive_step is not None:
            b = pf.arrive_step  # reads are taken in at the start of a step
        elif pf.end_step is not None:
            b = pf.end_step
        else:
            b = end_step
        a = pf.start_step
        if b < self.step0 or a > self.step1:
            return
        x0, x1 = self._x(a), self._x(max(b, a + 1))
        # on a dark backing, so it reads over the waiting and prefill colours alike
        p.fillRect(QRectF(x0, y + 2, max(2.0, x1 - x0), 6), QColor(P.BG))
        p.fillRect(QRectF(x0, y + 3, max(2.0, x1 - x0), 4), QColor(P.SERIES["prefetch"]))
        if pf.outcome == L.ARRIVED:
            p.setBrush(QColor(P.SERIES["arrived"]))
            p.setPen(Qt.PenStyle.NoPen)
            p.drawEllipse(QRectF(x1 - 3.5, y + 1.5, 7, 7))
        elif pf.outcome == L.RECOMPUTED:
            p.setPen(QPen(QColor(P.SERIES["missed"]), 2))
            p.drawLine(int(x1 - 3), y + 2, int(x1 + 3), y + 8)
            p.drawLine(int(x1 - 3), y + 8, int(x1 + 3), y + 2)

    def _paint_blocks(self, p: QPainter, s: L.SeqLife, y: int, end_step: int) -> None:
        """A light strip along the row's bottom whose height follows the block count."""
        if not s.blocks:
            return
        colour = QColor(255, 255, 255, 70)
        pts = s.blocks
        for j, (step, n) in enumerate(pts):
            nxt = pts[j + 1][0] if j + 1 < len(pts) else (
                s.finish_step + 1 if s.finish_step is not None else end_step)
            if n <= 0 or nxt < self.step0 or step > self.step1:
                continue
            h = (ROW_H - 4) * min(1.0, n / self._max_blocks)
            x0, x1 = self._x(step), self._x(nxt)
            p.fillRect(QRectF(x0, y + ROW_H - 2 - h, max(1.0, x1 - x0), h), colour)

    # ---------------------------------------------------------------- mouse
    def tooltip_at(self, pos: QPoint) -> str:
        idx = self.index
        if idx is None:
            return ""
        step = self._step_at(pos.x())
        if pos.y() < LANE_H:
            evs = [e for e in idx.evictions if abs(e["step"] - step) <= self._slop()]
            return "\n".join(f"step {e['step']}: evicted {e['blocks']} {e['tier']} block"
                             f"{'s' if e['blocks'] != 1 else ''}: "
                             f"{describe(e['cause'], 'evict')}" for e in evs[:8])
        r = self._row_at(pos.y())
        if r is None:
            return ""
        s = idx.seqs[self.rows[r]]
        lines = [f"<b>{s.seq_id}</b> · prompt {s.prompt_tokens} · out {s.output_tokens}"]
        for pre in s.preemptions:
            if abs(pre.step - step) <= self._slop():
                lines.append(f"preempted ({pre.mode}) at step {pre.step}: "
                             f"{describe(pre.cause, victim=s.seq_id)}")
        for ph in s.phases:
            end = ph.end_step if ph.end_step is not None else idx.last_step + 1
            if ph.start_step <= step < end:
                lines.append(f"{ph.kind}: steps {ph.start_step}–{end - 1}"
                             + (f" · {ph.detail}" if ph.detail else ""))
        lines += [_prefetch_text(pf) for pf in s.prefetches
                  if pf.start_step - self._slop() <= step
                  <= (pf.end_step if pf.end_step is not None else idx.last_step + 1)
                  + self._slop()]
        j = bisect.bisect_right([b for b, _ in s.blocks], step) - 1
        if j >= 0:
            lines.append(f"{s.blocks[j][1]} blocks at step {step}")
        lines.append(_tail(s) + f" · hit {s.hit_tokens} tok · recomputed "
                     f"{s.recomputed_tokens} tok")
        return "<br>".join(lines)

    def _slop(self) -> float:
        """Steps within 4 pixels of the pointer."""
        w = max(1, self.width() - LABEL_W - TAIL_W)
        return max(0.5, 4 * (self.step1 - self.step0) / w)

    def mouseMoveEvent(self, e) -> None:  # noqa: N802 (Qt)
        pos = e.position().toPoint()
        if self._drag_from is not None:
            self.range = (self._drag_from, self._step_at(pos.x()))
            self.update()
            return
        text = self.tooltip_at(pos)
        if text:
            QToolTip.showText(e.globalPosition().toPoint(), text, self)
        else:
            QToolTip.hideText()

    def mousePressEvent(self, e) -> None:  # noqa: N802 (Qt)
        pos = e.position().toPoint()
        if e.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self._drag_from = self._step_at(pos.x())
            self.range = (self._drag_from, self._drag_from)
            return
        r = self._row_at(pos.y())
        if r is not None:
            self.row_clicked.emit(self.rows[r])

    def mouseReleaseEvent(self, e) -> None:  # noqa: N802 (Qt)
        if self._drag_from is not None and self.range is not None:
            a, b = sorted(self.range)
            self._drag_from = None
            self.range_selected.emit(a, b)

    def wheelEvent(self, e) -> None:  # noqa: N802 (Qt)
        dy = e.angleDelta().y()
        if e.modifiers() & Qt.KeyboardModifier.ControlModifier:
            at = self._step_at(e.position().x())
            f = 0.8 if dy > 0 else 1.25
            self.step0 = int(at - (at - self.step0) * f)
            self.step1 = max(self.step0 + 2, int(at + (self.step1 - at) * f) + 1)
            self.update()
        else:
            self.parent().scroll_by(-3 if dy > 0 else 3)


def _prefetch_text(pf: L.PrefetchSpan) -> str:
    """One tooltip line: what a prefetch read and how it ended."""
    text = f"disk prefetch: {pf.blocks} block{'s' if pf.blocks != 1 else ''} from step " \
           f"{pf.start_step}"
    if pf.arrive_step is not None and pf.arrive_time is not None:
        text += f", arrived by step {pf.arrive_step} " \
                f"(+{(pf.arrive_time - pf.start_time) * 1e3:.0f} ms)"
    if pf.missed:
        text += f", {pf.missed} missed"
    if pf.outcome == L.RECOMPUTED:
        got = pf.arrived
        text += f"; gave up after {pf.wait_s * 1e3:.0f} ms with {got} of {pf.blocks} " \
                "arrived: the rest recomputed"
    elif pf.outcome == L.LEFT:
        text += "; the request left while waiting"
    elif pf.outcome is None:
        text += "; reads in flight"
    return text


def _tail(s: L.SeqLife) -> str:
    parts = []
    if s.ttft is not None:
        parts.append(f"TTFT {s.ttft * 1e3:.0f} ms")
    if s.tpot is not None:
        parts.append(f"TPOT {s.tpot * 1e3:.0f} ms")
    if s.preemptions:
        n = len(s.preemptions)
        parts.append(f"{n} preemption{'s' if n != 1 else ''}")
    return " · ".join(parts)


class LifecycleView(QWidget):
    """The Gantt canvas with its vertical scroll bar; follows an InspectorModel."""

    def __init__(self, model=None) -> None:
        super().__init__()
        self.model = model
        self.canvas = GanttCanvas(self)
        self.scroll = QScrollBar(Qt.Orientation.Vertical)
        self.scroll.valueChanged.connect(self._on_scroll)
        self.filter_text = ""
        lay = QHBoxLayout()
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(0)
        lay.addWidget(self.canvas, 1)
        lay.addWidget(self.scroll)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addLayout(lay)
        self.canvas.row_clicked.connect(self._select)
        if model is not None:
            model.selection_changed.connect(self._on_selection)
            model.cursor_changed.connect(self._on_cursor)

    # ------------------------------------------------------------------ api
    def set_index(self, index: L.LifecycleIndex | None) -> None:
        self.canvas.index = index
        self.canvas.fit_steps()
        self.refresh()

    def refresh(self) -> None:
        """Re-read the index (it grows live): rows, block scale, scroll range."""
        idx = self.canvas.index
        if idx is None:
            return
        f = self.filter_text.lower()
        self.canvas.rows = [sid for sid in idx.order if f in sid.lower()] if f \
            else list(idx.order)
        self.canvas._max_blocks = max(
            (n for s in idx.seqs.values() for _, n in s.blocks[-8:]), default=1) or 1
        if self.canvas.step1 <= idx.last_step and len(idx.steps["step"]):
            self.canvas.step1 = idx.last_step + 1  # live: the axis grows with the run
        self.scroll.setRange(0, max(0, len(self.canvas.rows) - self.canvas.visible_rows))
        self.scroll.setPageStep(self.canvas.visible_rows)
        self.canvas.update()

    def set_filter(self, text: str) -> None:
        self.filter_text = text
        self.scroll.setValue(0)
        self.refresh()

    def find(self, text: str) -> str | None:
        """Select the first sequence whose id contains ``text``; its id, or None."""
        t = text.lower()
        for i, sid in enumerate(self.canvas.rows):
            if t in sid.lower():
                self._select(sid)
                self.scroll_to_row(i)
                return sid
        return None

    def scroll_to_row(self, i: int) -> None:
        if not self.canvas.top <= i < self.canvas.top + self.canvas.visible_rows:
            self.scroll.setValue(max(0, i - self.canvas.visible_rows // 2))

    def scroll_by(self, rows: int) -> None:
        self.scroll.setValue(self.scroll.value() + rows)

    # -------------------------------------------------------------- signals
    def _on_scroll(self, v: int) -> None:
        self.canvas.top = v
        self.canvas.update()

    def _select(self, sid: str) -> None:
        self.canvas.selected = sid
        if self.model is not None:
            self.model.select_seq(sid)
        self.canvas.update()

    def _on_selection(self) -> None:
        sel = self.model.selected_seq
        if sel != self.canvas.selected:
            self.canvas.selected = sel
            if sel in self.canvas.rows:
                self.scroll_to_row(self.canvas.rows.index(sel))
            self.canvas.update()

    def _on_cursor(self, step: int) -> None:
        self.canvas.cursor_step = step
        self.canvas.update()

    def resizeEvent(self, e) -> None:  # noqa: N802 (Qt)
        super().resizeEvent(e)
        self.refresh()
