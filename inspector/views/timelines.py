"""Memory timelines: stacked used/cached/free blocks per tier, prefix hit rate,
running/waiting/swapped counts and throughput over steps, with preemption and eviction
markers. X is the engine step; plots share it (zoom/pan one, all follow). A click asks the
replay to seek there (``seek_requested``); "follow live" keeps the newest steps in view."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QFont
from PySide6.QtWidgets import QCheckBox, QGraphicsItem, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from inspector import palette as P
from inspector.model import InspectorModel

FOLLOW_WINDOW = 600  # steps kept in view while following live


def _pen(colour: str, width: float = 1.5) -> Any:
    return pg.mkPen(colour, width=width)


def _brush(colour: str, alpha: int = 150) -> Any:
    r, g, b, _ = P.rgba(colour)
    return pg.mkBrush(r, g, b, alpha)


class TimelinesView(QWidget):
    seek_requested = Signal(int)

    def __init__(self, model: InspectorModel, parent: QWidget | None = None) -> None:
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
            p = self.canvas.addPlot(row=row, col=0)
            p.setLabel("left", f"<span style='color:{P.TEXT_DIM}; font-size:8pt'>{title}</span>")
            p.showGrid(x=True, y=True, alpha=0.15)
            p.getAxis("bottom").setStyle(showValues=False)
            p.getAxis("left").setStyle(tickFont=self._tick_font)
            p.setMenuEnabled(False)
            p.setClipToView(True)
            p.setDownsampling(auto=True, mode="peak")
            for ax in ("left", "bottom"):
                p.getAxis(ax).setTextPen(P.TEXT_DIM)
                p.getAxis(ax).setPen(P.GRID)
            p.getAxis("left").setWidth(64)
            if self.plots:
                p.setXLink(next(iter(self.plots.values())))
            cursor = pg.InfiniteLine(angle=90, pen=pg.mkPen(P.TEXT, width=1,
                                                             style=Qt.PenStyle.DashLine))
            p.addItem(cursor, ignoreBounds=True)
            self.cursors.append(cursor)
            self.plots[key] = p
            return p

        for row, tier in enumerate(("gpu", "cpu")):
            p = plot(tier, f"{tier.upper()} blocks", row)
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
        p = plot("hit", "hit rate", 2)
        p.setYRange(0, 1, padding=0.05)
        self.curves["hit"] = p.plot(pen=_pen(P.SERIES["hit"], 2), antialias=False)
        p = plot("seqs", "sequences", 3)
        for k in ("running", "waiting", "swapped"):
            self.curves[k] = p.plot(pen=_pen(P.SERIES[k], 1.5), stepMode=None, antialias=False)
        p = plot("tput", "tokens/s", 4)
        self.curves["tput"] = p.plot(pen=_pen(P.SERIES["throughput"], 1.5), antialias=False)
        p.getAxis("bottom").setStyle(showValues=True, tickFont=self._tick_font)
        p.setLabel("bottom", f"<span style='color:{P.TEXT_DIM}; font-size:8pt'>engine step</span>")
        for row, stretch in enumerate((3, 2, 1, 2, 1)):
            self.canvas.ci.layout.setRowStretchFactor(row, stretch)
        self._cpu_shown = True

        legend = QLabel(" ".join(
            f"<span style='color:{c}'>■</span> {n}" for n, c in (
                ("used", P.USED), ("cached", P.CACHED), ("free", P.SERIES["free"]),
                ("swapped", P.SWAPPED), ("▲ preemption", P.SERIES["preempt"]),
                ("● eviction", P.SERIES["evict"]), ("◆ demotion", P.SERIES["demote"]),
                ("hit rate", P.SERIES["hit"]),
                ("running", P.SERIES["running"]), ("waiting", P.SERIES["waiting"]),
                ("tokens/s", P.SERIES["throughput"])))
            .replace("■</span> ▲", "▲</span>").replace("■</span> ●", "●</span>")
            .replace("■</span> ◆", "◆</span>"))
        top = QHBoxLayout()
        top.addWidget(legend)
        top.addStretch(1)
        top.addWidget(self.follow)
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
        has_cpu = bool(tl.n) and float(np.max(tl.col("cpu_used") + tl.col("cpu_cached")
                                              + tl.col("cpu_free"))) > 0
        self._show_cpu(has_cpu)
        for tier in ("gpu", "cpu"):
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
        self.curves["hit"].setData(x, np.nan_to_num(tl.hit_rate(), nan=0.0))
        for k in ("running", "waiting", "swapped"):
            self.curves[k].setData(x, tl.col(k))
        self.curves["tput"].setData(x, np.nan_to_num(tl.throughput(), nan=0.0))
        self._apply_follow()

    def _show_cpu(self, on: bool) -> None:
        """Take the host plot out of the layout when no host tier reports (no empty band)."""
        if on == self._cpu_shown:
            return
        self._cpu_shown = on
        p = self.plots["cpu"]
        if on:
            self.canvas.ci.addItem(p, row=1, col=0)
            p.show()
        else:
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
