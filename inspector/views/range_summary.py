"""Range summary: what happened between two steps, from
engine.events.analysis.ranges.range_summary. The range is chosen by dragging the shaded region on
the costs timeline (recompute share, internal fragmentation, prefix hit rate over steps),
by shift-dragging on the lifecycle view, or with the two step boxes. Below: decode step
time by context length (latency creep)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtWidgets import (
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from kvscope.engine.events.analysis.lifecycle import LifecycleIndex
from kvscope.engine.events.analysis.ranges import range_summary
from kvscope.inspector import palette as P

FIELDS = (
    ("steps", "steps", "{:,}"), ("seconds", "duration", "{:.2f} s"),
    ("requests_finished", "requests finished", "{:,}"),
    ("prefill_tokens", "prefill tokens", "{:,}"), ("decode_tokens", "decode tokens", "{:,}"),
    ("hit_rate", "prefix hit rate", "{:.1%}"),
    ("preemptions", "preemptions", "{:,}"), ("evicted_blocks", "evicted blocks", "{:,}"),
    ("swap_out_blocks", "swapped out (blocks)", "{:,}"),
    ("swap_in_blocks", "swapped in (blocks)", "{:,}"),
    ("recomputed_tokens", "recomputed tokens", "{:,}"),
    ("recompute_share", "recompute share of prefill", "{:.1%}"),
    ("peak_gpu_blocks", "peak gpu blocks", "{:,}"),
    ("peak_running", "peak running", "{:,}"), ("peak_waiting", "peak waiting", "{:,}"),
    ("fragmentation", "internal fragmentation", "{:.1%}"),
)


def format_value(fmt: str, v: Any) -> str:
    return "—" if v is None else fmt.format(v)


class RangeSummaryView(QWidget):
    def __init__(self) -> None:
        super().__init__()
        self.index: LifecycleIndex | None = None
        self.first, self.last = QSpinBox(), QSpinBox()
        for box in (self.first, self.last):
            box.setRange(0, 1 << 30)
            box.valueChanged.connect(self.update_summary)
        head = QHBoxLayout()
        head.addWidget(QLabel("steps"))
        head.addWidget(self.first)
        head.addWidget(QLabel("to"))
        head.addWidget(self.last)
        head.addStretch(1)
        form = QFormLayout()
        self.values: dict[str, QLabel] = {}
        for key, label, _ in FIELDS:
            self.values[key] = QLabel("—")
            form.addRow(label, self.values[key])
        self.creep = QLabel("")
        self.creep.setWordWrap(True)
        self.plot = pg.PlotWidget()
        self.plot.setBackground(P.PANEL)
        self.plot.setMenuEnabled(False)
        self.plot.setYRange(0, 1, padding=0.02)
        self.plot.showGrid(x=True, y=True, alpha=0.15)
        self.plot.addLegend(offset=(8, 4), labelTextSize="8pt")
        self.curves = {
            name: self.plot.plot(pen=pg.mkPen(colour, width=1.5), name=name, antialias=False)
            for name, colour in (("recompute share (cumulative)", P.ERROR),
                                 ("internal fragmentation", P.WARN),
                                 ("prefix hit rate", P.SERIES["hit"]))
        }
        self.region = pg.LinearRegionItem(brush=pg.mkBrush(90, 169, 230, 40))
        self.region.sigRegionChangeFinished.connect(self._region_moved)
        self.plot.addItem(self.region)
        left = QVBoxLayout()
        left.addLayout(head)
        left.addLayout(form)
        left.addStretch(1)
        right = QVBoxLayout()
        right.addWidget(QLabel("<b>costs over steps</b> (drag the shaded range)"))
        right.addWidget(self.plot, 1)
        right.addWidget(QLabel("<b>decode step time by context length</b>"))
        right.addWidget(self.creep)
        lay = QHBoxLayout(self)
        lay.addLayout(left)
        lay.addLayout(right, 1)
        self.summary: dict[str, Any] = {}

    def set_index(self, index: LifecycleIndex | None) -> None:
        self.index = index
        if index is not None and len(index.steps["step"]):
            self.plot_costs()
            self.set_range(int(index.steps["step"][0]), index.last_step)

    def plot_costs(self) -> None:
        st = self.index.steps
        x = st["step"].astype(np.float64)
        pre, redo = np.cumsum(st["prefill_tokens"]), np.cumsum(st["recomputed_tokens"])
        share = np.divide(redo, pre, out=np.zeros(len(x)), where=pre > 0)
        slots = st["occupied_slots"].astype(np.float64)
        frag = np.divide(slots - st["occupied_tokens"], slots, out=np.zeros(len(x)),
                         where=slots > 0)
        # cumulative counters (-1 where a recording did not carry them)
        hit = np.diff(np.maximum(st["hit_tokens"], 0), prepend=0)
        query = np.diff(np.maximum(st["query_tokens"], 0), prepend=0)
        # hit rate over a trailing 20-step window (one step's lookups are too few)
        k = np.ones(20)
        h, q = np.convolve(hit, k)[: len(x)], np.convolve(query, k)[: len(x)]
        rate = np.divide(h, q, out=np.full(len(x), np.nan), where=q > 0)
        for curve, y in zip(self.curves.values(), (share, frag, rate), strict=True):
            curve.setData(x, y, connect="finite")

    def set_range(self, first: int, last: int) -> None:
        for box, v in ((self.first, first), (self.last, last)):
            box.blockSignals(True)
            box.setValue(v)
            box.blockSignals(False)
        self.update_summary()

    def _region_moved(self) -> None:
        a, b = self.region.getRegion()
        self.set_range(int(round(a)), int(round(b)))

    def update_summary(self) -> None:
        if self.index is None:
            return
        self.summary = range_summary(self.index, self.first.value(), self.last.value())
        self.region.blockSignals(True)
        self.region.setRegion((self.first.value(), self.last.value()))
        self.region.blockSignals(False)
        for key, _, fmt in FIELDS:
            self.values[key].setText(format_value(fmt, self.summary.get(key)))
        bins = self.index.decode_time_by_context()
        self.creep.setText("  ".join(f"{lo}–{hi} tok: {t * 1e3:.0f} ms ({n})"
                                     for lo, hi, t, n in bins[:12]) or "—")
