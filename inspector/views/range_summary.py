"""Range summary: what happened between two steps (shift-drag on the lifecycle view, or
the two step boxes), from engine.events.ranges.range_summary, plus the run's costs:
recompute share, internal fragmentation and decode time by context length."""

from __future__ import annotations

from typing import Any

from PySide6.QtWidgets import (
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from engine.events.lifecycle import LifecycleIndex
from engine.events.ranges import range_summary

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
        lay = QVBoxLayout(self)
        lay.addLayout(head)
        lay.addLayout(form)
        lay.addWidget(QLabel("<b>decode step time by context length</b>"))
        lay.addWidget(self.creep)
        lay.addStretch(1)
        self.summary: dict[str, Any] = {}

    def set_index(self, index: LifecycleIndex | None) -> None:
        self.index = index
        if index is not None and len(index.steps["step"]):
            self.set_range(int(index.steps["step"][0]), index.last_step)

    def set_range(self, first: int, last: int) -> None:
        for box, v in ((self.first, first), (self.last, last)):
            box.blockSignals(True)
            box.setValue(v)
            box.blockSignals(False)
        self.update_summary()

    def update_summary(self) -> None:
        if self.index is None:
            return
        self.summary = range_summary(self.index, self.first.value(), self.last.value())
        for key, _, fmt in FIELDS:
            self.values[key].setText(format_value(fmt, self.summary.get(key)))
        bins = self.index.decode_time_by_context()
        self.creep.setText("  ".join(f"{lo}–{hi} tok: {t * 1e3:.0f} ms ({n})"
                                     for lo, hi, t, n in bins[:12]) or "—")
