"""Memory timelines: stacked used/cached/free blocks per tier (gpu, host, disk: a tier's
row shows only when it reports; the disk row also marks the steps where prefetch reads
started, arrived and missed, in blocks), running/waiting/swapped
counts, throughput, the costs (prefix hit rate, prefix savings, recompute share,
internal fragmentation, in %) and decode step time beside the mean decoded context
(latency creep), with preemption and eviction markers. X is the engine step; plots share
it (zoom/pan one, all follow). A click asks the replay to seek there (``seek_requested``);
"follow live" keeps the newest steps in view.

Each plot's title sits inside its top-left corner (rotated axis titles collide on short
plots), and its y axis shows major ticks only, at a fixed width, so labels never crowd.
The cost rows come from the lifecycle index (``set_costs``), the rest from the timeline's
step stats."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFont
from PySide6.QtWidgets import (
    QCheckBox,
    QGraphicsItem,
    QGraphicsSimpleTextItem,
    QHBoxLayout,
    QVBoxLayout,
    QWidget,
)

from kvscope.engine.events.analysis.costs import cost_series
from kvscope.inspector import palette as P
from kvscope.inspector.model import InspectorModel
from kvscope.inspector.views.legend import Legend

TIER_ROWS = ("gpu", "cpu", "disk")  # the tier plots, rows 0..2
FOLLOW_WINDOW = 600  # steps kept in view while following live
AXIS_W = 52  # px: the same left-axis width on every plot keeps their x aligned
# Major ticks only; at most ~40% of a short axis covered by tick text.
_AXIS_STYLE = {"maxTickLevel": 0, "textFillLimits": [(0, 0.4)], "autoExpandTextSpace": False}
COST_COLOURS = {"hit": P.SERIES["hit"], "prefix_saved": "#7fd67f",
                "recompute_share": P.SERIES["preempt"], "fragmentation": "#c08cf0",
                "decode_ms": "#e8e8e8", "decode_context": "#e0a060"}


class SparseAxis(pg.AxisItem):
    """An axis whose major ticks are at least ``MIN_TICK_PX`` apart (1-2-2.5-5 steps), so a
    short plot shows one or two labels instead of three crowded ones."""

    MIN_TICK_PX = 15.0

    def tickSpacing(self, minVal: float, maxVal: float, size: float):  # noqa: N802, N803
        if self._tickSpacing is not None:
            return self._tickSpacing
        dif = abs(maxVal - minVal)
        if dif == 0 or size <= 0:
            return []
        want = dif * self.MIN_TICK_PX / size  # the smallest spacing that keeps labels apart
        p10 = 10.0 ** math.floor(math.log10(want))
        # 2.5 steps only where they stay whole numbers (25, 250, ...): "2.5" would print "2"
        steps = (1, 2, 2.5, 5, 10) if p10 >= 10 else (1, 2, 5, 10)
        step = next(m * p10 for m in steps if m * p10 >= want)
        return [(step, 0)]


def _pen(colour: str, width: float = 1.5) -> Any:
    return pg.mkPen(colour, width=width)


def _brush(colour: str, alpha: int = 150) -> Any:
    r, g, b, _ = P.rgba(colour)
    return pg.mkBrush(r, g, b, alpha)


class TimelinesView(QWidget):
    seek_requested = Signal(int)

    def __init__(self, model: InspectorModel, parent: QWidget | None = None,
                 costs: bool = True) -> None:
        """``costs``: also draw the rows fed by a lifecycle index (``set_costs``); a view
        without one (a fleet replica) shows the hit rate alone in the % row."""
        super().__init__(parent)
        self.model = model
        self.canvas = pg.GraphicsLayoutWidget()
        self.canvas.setBackground(P.PANEL)
        self.follow = QCheckBox("follow live")
        self.follow.toggled.connect(self._apply_follow)
        self.plots: dict[str, pg.PlotItem] = {}
        self.curves: dict[str, pg.PlotDataItem] = {}
        self.cursors: list[pg.InfiniteLine] = []
        self._tick_font = QFont("DejaVu Sans", 8)

        def plot(key: str, title: str, row: int) -> pg.PlotItem:
            p = self.canvas.addPlot(row=row, col=0, axisItems={
                "left": SparseAxis("left"), "right": SparseAxis("right")})
            self._title(p, title)
            p.showGrid(x=True, y=True, alpha=0.15)
            p.getAxis("bottom").setStyle(showValues=False)
            p.getAxis("left").setStyle(tickFont=self._tick_font, **_AXIS_STYLE)
            p.setMenuEnabled(False)
            p.setClipToView(True)
            p.setDownsampling(auto=True, mode="peak")
            for ax in ("left", "bottom"):
                p.getAxis(ax).setTextPen(P.TEXT_DIM)
                p.getAxis(ax).setPen(P.GRID)
            p.getAxis("left").setWidth(AXIS_W)
            p.showAxis("right")  # on every plot, so all data areas share their x extent
            p.getAxis("right").setStyle(showValues=False)
            p.getAxis("right").setPen(P.GRID)
            p.getAxis("right").setWidth(AXIS_W)
            if self.plots:
                p.setXLink(next(iter(self.plots.values())))
            cursor = pg.InfiniteLine(angle=90, pen=pg.mkPen(P.TEXT, width=1,
                                                             style=Qt.PenStyle.DashLine))
            p.addItem(cursor, ignoreBounds=True)
            self.cursors.append(cursor)
            self.plots[key] = p
            return p

        for row, tier in enumerate(TIER_ROWS):
            p = plot(tier, "DISK blocks · prefetch blocks (right)"
                     if tier == "disk" else f"{tier.upper()} blocks", row)
            # Stacked areas: draw the totals back to front, each filled down to 0.
            for part, colour in (("free", P.SERIES["free"]), ("cached", P.CACHED),
                                 ("used", P.USED if tier == "gpu" else P.SWAPPED)):
                # No antialiasing on long curves: QPainter's antialiased fills of tens of
                # thousands of points cost ~25 ms each and are redrawn on every seek.
                self.curves[f"{tier}_{part}"] = p.plot(
                    pen=_pen(colour, 1), fillLevel=0, brush=_brush(colour), name=part,
                    antialias=False)
            self.curves[f"{tier}_preempt"] = p.plot(
                pen=None, symbol="t", symbolSize=9, symbolBrush=P.SERIES["preempt"],
                symbolPen=None)
            self.curves[f"{tier}_evict"] = p.plot(
                pen=None, symbol="o", symbolSize=6, symbolBrush=P.SERIES["evict"],
                symbolPen=None)
            self.curves[f"{tier}_demote"] = p.plot(
                pen=None, symbol="d", symbolSize=7, symbolBrush=P.SERIES["demote"],
                symbolPen=None)
        self.prefetch_view = self._right_axis(self.plots["disk"], "blocks")
        for key, symbol in (("prefetch", "t"), ("arrived", "o"), ("missed", "x")):
            self.curves[key] = pg.PlotDataItem(pen=None, symbol=symbol, symbolSize=6,
                                               symbolBrush=P.SERIES[key], symbolPen=None)
            self.prefetch_view.addItem(self.curves[key])
        p = plot("seqs", "sequences", 3)
        for k in ("running", "waiting", "swapped"):
            self.curves[k] = p.plot(pen=_pen(P.SERIES[k], 1.5), stepMode=None, antialias=False)
        p = plot("tput", "tokens/s", 4)
        self.curves["tput"] = p.plot(pen=_pen(P.SERIES["throughput"], 1.5), antialias=False)
        p = plot("hit", "% hit · saved · recompute · fragmentation" if costs
                 else "prefix hit rate", 5)
        p.setYRange(-10, 110, padding=0)  # room for the 0% and 100% labels when tall
        p.getAxis("left").setTicks([[(v, f"{v}%") for v in (0, 50, 100)]])
        p.setMouseEnabled(y=False)  # a share: 0..100 always
        self.curves["hit"] = p.plot(pen=_pen(COST_COLOURS["hit"], 2), antialias=False)
        for k in ("prefix_saved", "recompute_share", "fragmentation") if costs else ():
            self.curves[k] = p.plot(pen=_pen(COST_COLOURS[k], 1.5), antialias=False)
        self.threshold_lines = {
            "gpu": pg.InfiniteLine(angle=0, pen=pg.mkPen(P.WARN, width=1,
                                                         style=Qt.PenStyle.DashLine)),
            "hit": pg.InfiniteLine(angle=0, pen=pg.mkPen(P.WARN, width=1,
                                                         style=Qt.PenStyle.DashLine))}
        for key, line in self.threshold_lines.items():
            self.plots[key].addItem(line, ignoreBounds=True)
            line.hide()
        if costs:
            p = plot("decode", "decode ms/step · mean context (right)", 6)
            # a line, not dots: tens of thousands of symbols cost a seek's redraw dearly
            self.curves["decode_ms"] = p.plot(pen=_pen(COST_COLOURS["decode_ms"], 1),
                                              antialias=False)
            self.context_view = self._right_axis(p, "tokens")
            self.curves["decode_context"] = pg.PlotDataItem(
                pen=_pen(COST_COLOURS["decode_context"], 1.5), antialias=False)
            self.context_view.addItem(self.curves["decode_context"])
        p.getAxis("bottom").setStyle(showValues=True, tickFont=self._tick_font)
        p.setLabel("bottom", f"<span style='color:{P.TEXT_DIM}; font-size:8pt'>engine step</span>")
        for row, stretch in enumerate((3, 2, 2, 2, 1, 2, 2)[: 7 if costs else 6]):
            self.canvas.ci.layout.setRowStretchFactor(row, stretch)
        self._shown = set(TIER_ROWS)

        self.legend = Legend()
        cost_entries = (
            ("■", "prefix saved", COST_COLOURS["prefix_saved"]),
            ("■", "recompute share", COST_COLOURS["recompute_share"]),
            ("■", "fragmentation", COST_COLOURS["fragmentation"]),
            ("■", "decode ms", COST_COLOURS["decode_ms"]),
            ("■", "mean context", COST_COLOURS["decode_context"]),
            ("┅", "alert threshold", P.WARN)) if costs else ()
        self.legend.set_entries([(c, g, n, "") for g, n, c in (
            ("■", "used", P.USED), ("■", "cached", P.CACHED), ("■", "free", P.SERIES["free"]),
            ("■", "swapped", P.SWAPPED), ("▲", "preemption", P.SERIES["preempt"]),
            ("●", "eviction", P.SERIES["evict"]), ("◆", "demotion", P.SERIES["demote"]),
            ("▲", "prefetch started", P.SERIES["prefetch"]),
            ("●", "prefetch arrived", P.SERIES["arrived"]),
            ("✕", "prefetch missed", P.SERIES["missed"]),
            ("■", "running", P.SERIES["running"]), ("■", "waiting", P.SERIES["waiting"]),
            ("■", "tokens/s", P.SERIES["throughput"]), ("■", "hit rate", COST_COLOURS["hit"]),
            *cost_entries)])
        top = QHBoxLayout()
        top.addWidget(self.legend, 1)
        top.addWidget(self.follow, 0, Qt.AlignmentFlag.AlignTop)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addLayout(top)
        lay.addWidget(self.canvas, 1)

        self.canvas.scene().sigMouseClicked.connect(self._on_click)
        model.timeline_changed.connect(self.refresh)
        model.cursor_changed.connect(self.set_cursor)
        # A seek moves the cursor lines only: keep each curve's and axis's (with its grid)
        # rendering as a pixmap so those repaints blit it instead of redrawing 10^4-10^5
        # points per curve (re-drawn only when its data or the view's range changes).
        cached = [item for c in self.curves.values() for item in (c.curve, c.scatter)]
        cached += [p.getAxis(ax) for p in self.plots.values() for ax in ("left", "bottom")]
        for item in cached:
            item.setCacheMode(QGraphicsItem.CacheMode.DeviceCoordinateCache)

    def refresh(self) -> None:
        tl = self.model.timeline
        x = tl.col("step")
        for tier in TIER_ROWS[1:]:
            self._show_tier(tier, bool(tl.n) and float(np.max(
                tl.col(f"{tier}_used") + tl.col(f"{tier}_cached") + tl.col(f"{tier}_free"))) > 0)
        for key, column in (("prefetch", "prefetched"), ("arrived", "arrived"),
                            ("missed", "missed")):
            v = tl.col(column)
            self.curves[key].setData(x[v > 0], v[v > 0])
        for tier in TIER_ROWS:
            used, cached = tl.col(f"{tier}_used"), tl.col(f"{tier}_cached")
            total = used + cached + tl.col(f"{tier}_free")
            self.curves[f"{tier}_used"].setData(x, used)
            self.curves[f"{tier}_cached"].setData(x, used + cached)
            self.curves[f"{tier}_free"].setData(x, total)
            pre = tl.col("preemptions") > 0
            ev = tl.col("evictions") > 0
            self.curves[f"{tier}_preempt"].setData(x[pre], total[pre] * 0.97)
            self.curves[f"{tier}_evict"].setData(x[ev], total[ev] * 0.8)
            de = tl.col("demotions") > 0
            self.curves[f"{tier}_demote"].setData(x[de], total[de] * 0.65)
        self.curves["hit"].setData(x, np.nan_to_num(tl.hit_rate(), nan=0.0) * 100)
        for k in ("running", "waiting", "swapped"):
            self.curves[k].setData(x, tl.col(k))
        self.curves["tput"].setData(x, np.nan_to_num(tl.throughput(), nan=0.0))
        self._apply_follow()

    def set_costs(self, index: object) -> None:
        """Draw the cost rows from a LifecycleIndex (its per-step columns)."""
        c = cost_series(index)  # type: ignore[arg-type]
        x = c["step"]
        for k in ("prefix_saved", "recompute_share", "fragmentation"):
            self.curves[k].setData(x, c[k] * 100, connect="finite")
        has = np.isfinite(c["decode_ms"])
        self.curves["decode_ms"].setData(x[has], c["decode_ms"][has])
        self.curves["decode_context"].setData(x[has], c["decode_context"][has])

    def set_thresholds(self, utilization: float | None, hit_rate: float | None) -> None:
        """Dashed lines at the alert thresholds (None hides one): utilization as a fraction
        of the GPU tier's blocks, hit rate as a fraction."""
        tl = self.model.timeline
        total = float((tl.col("gpu_used") + tl.col("gpu_cached") + tl.col("gpu_free"))[-1]) \
            if tl.n else 0.0
        for key, value in (("gpu", None if utilization is None or not total
                            else utilization * total),
                           ("hit", None if hit_rate is None else hit_rate * 100)):
            line = self.threshold_lines[key]
            line.setVisible(value is not None)
            if value is not None:
                line.setValue(value)

    @staticmethod
    def _title(p: pg.PlotItem, title: str) -> None:
        """The plot's name in its top-left corner, in screen pixels (a child of the view
        box, not of its data), above the curves."""
        label = QGraphicsSimpleTextItem(title, p.vb)
        label.setBrush(pg.mkBrush(P.TEXT_DIM))
        label.setFont(QFont("DejaVu Sans", 8))
        label.setPos(4, 1)
        label.setZValue(100)

    def _right_axis(self, p: pg.PlotItem, unit: str) -> pg.ViewBox:
        """A second y axis on the right of ``p``, with its own view box sharing x."""
        vb = pg.ViewBox()
        vb.setMenuEnabled(False)
        p.showAxis("right")
        ax = p.getAxis("right")
        ax.setStyle(showValues=True, tickFont=self._tick_font, **_AXIS_STYLE)
        ax.setTextPen(P.TEXT_DIM)
        ax.setPen(P.GRID)
        ax.setWidth(AXIS_W)
        p.scene().addItem(vb)
        ax.linkToView(vb)
        vb.setXLink(p)

        def follow() -> None:
            vb.setGeometry(p.vb.sceneBoundingRect())
            vb.linkedViewChanged(p.vb, vb.XAxis)

        p.vb.sigResized.connect(follow)
        return vb

    def _show_tier(self, tier: str, on: bool) -> None:
        """Take a tier's plot out of the layout when the tier does not report (no empty
        band)."""
        if on == (tier in self._shown):
            return
        p = self.plots[tier]
        if on:
            self._shown.add(tier)
            self.canvas.ci.addItem(p, row=TIER_ROWS.index(tier), col=0)
            p.show()
        else:
            self._shown.discard(tier)
            self.canvas.ci.removeItem(p)
            p.hide()

    def set_cursor(self, step: int) -> None:
        for c in self.cursors:
            c.setValue(step)

    def _apply_follow(self) -> None:
        tl = self.model.timeline
        if self.follow.isChecked() and tl.n:
            last = float(tl.col("step")[-1])
            self.plots["gpu"].setXRange(max(0.0, last - FOLLOW_WINDOW), last, padding=0.01)

    def _on_click(self, ev: Any) -> None:
        if ev.button() != Qt.MouseButton.LeftButton or not self.model.timeline.n:
            return
        for p in self.plots.values():
            if p.isVisible() and p.vb.sceneBoundingRect().contains(ev.scenePos()):
                step = p.vb.mapSceneToView(ev.scenePos()).x()
                tl = self.model.timeline
                self.seek_requested.emit(int(tl.col("step")[tl.index_of_step(step)]))
                return
