"""Replay controls: jump to start, step back, play/pause, step forward, jump to end, a
timeline slider and the speed (0.25x..16x). Drives a ReplayController; draws its position."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QPushButton, QSlider, QWidget

from kvscope.inspector import palette as P
from kvscope.inspector.sources.replay import SPEEDS, ReplayController


class ReplayBar(QWidget):
    def __init__(self, replay: ReplayController, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.replay = replay

        def button(text: str, tip: str, slot) -> QPushButton:  # noqa: ANN001
            b = QPushButton(text)
            b.setToolTip(tip)
            b.setFixedWidth(38)
            b.clicked.connect(slot)
            return b

        self.start = button("|◀", "jump to start", replay.to_start)
        self.back = button("◀◀", "step back one engine step", replay.step_back)
        self.play = button("▶", "play / pause (space)", replay.toggle)
        self.fwd = button("▶▶", "step forward one engine step", replay.step_forward)
        self.end = button("▶|", "jump to end", replay.to_end)
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setRange(0, max(0, replay.num_steps - 1))
        self.slider.setTracking(True)
        self.slider.valueChanged.connect(self._on_slider)
        self.speed = QComboBox()
        for s in SPEEDS:
            self.speed.addItem(f"{s:g}×", s)
        self.speed.setCurrentIndex(SPEEDS.index(1.0))
        self.speed.currentIndexChanged.connect(
            lambda i: replay.set_speed(self.speed.itemData(i)))
        self.position = QLabel()
        self.position.setStyleSheet(f"color: {P.TEXT}; font-family: monospace;")
        self.position.setMinimumWidth(240)

        lay = QHBoxLayout(self)
        lay.setContentsMargins(6, 2, 6, 2)
        for w in (self.start, self.back, self.play, self.fwd, self.end):
            lay.addWidget(w)
        lay.addWidget(self.slider, 1)
        lay.addWidget(self.speed)
        lay.addWidget(self.position)
        replay.position_changed.connect(self._on_position)
        replay.playing_changed.connect(lambda on: self.play.setText("❚❚" if on else "▶"))

    def _on_slider(self, value: int) -> None:
        if value != self.replay.index:
            self.replay.seek_index(value)

    def _on_position(self, index: int) -> None:
        self.slider.blockSignals(True)
        self.slider.setValue(index)
        self.slider.blockSignals(False)
        self.position.setText(
            f"step {self.replay.step:,} · {index + 1:,}/{self.replay.num_steps:,} · "
            f"+{self.replay.elapsed():.2f} s")
