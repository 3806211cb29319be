"""ReplayController: plays a recording into the InspectorModel.

The recording (``engine.events`` Recording, or ``MemoryRecording``) provides
``steps``, ``state_at(step)`` (keyframe + deltas: the seek) and ``batches(start_step)``.
One pass at open reads every batch's stats into the timeline. Playing applies the
following batches to the current frame at the recording's own pace times ``speed``;
the model only ever sees whole-batch states.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from PySide6.QtCore import QObject, QTimer, Signal

from kvscope.engine.events import KVState, ProtocolError
from kvscope.inspector.model import InspectorModel

SPEEDS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
FALLBACK_STEPS_PER_S = 20.0  # pace when the recording's timestamps do not advance
LOG_CONTEXT_STEPS = 50  # steps of events shown in the log after a seek
TICK_MS = 33


class ReplayController(QObject):
    position_changed = Signal(int)  # index into steps
    playing_changed = Signal(bool)
    error = Signal(str)  # a batch the recording holds could not be read or applied

    def __init__(self, recording: Any, model: InspectorModel) -> None:
        super().__init__()
        self.recording = recording
        self.model = model
        self.speed = 1.0
        self.index = -1
        self._state = KVState()
        self._iter: Any = None  # batches after the current one, while playing
        self._clock = 0.0  # replay time (recording seconds) while playing
        self._last_tick = 0.0
        self._timer = QTimer(self)
        self._timer.setInterval(TICK_MS)
        self._timer.timeout.connect(self._tick)
        model.timeline.clear()
        self.epoch = ""
        for b in recording.batches():
            self.epoch = self.epoch or str(b.get("epoch", ""))
            model.timeline.append(b)
        self.steps = np.asarray(model.timeline.col("step"), dtype=np.int64)
        times = np.asarray(model.timeline.col("time"))
        self._times = times if len(times) > 1 and times[-1] > times[0] else (
            np.arange(len(self.steps)) / FALLBACK_STEPS_PER_S)
        model.timeline_changed.emit()

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    @property
    def step(self) -> int:
        return int(self.steps[self.index]) if self.index >= 0 else -1

    @property
    def playing(self) -> bool:
        return self._timer.isActive()

    def elapsed(self) -> float:
        """Recording seconds from the first step to the current one."""
        return float(self._times[self.index] - self._times[0]) if self.index >= 0 else 0.0

    # --------------------------------------------------------------- seeking
    def seek_index(self, index: int) -> None:
        if not self.num_steps:
            return
        index = max(0, min(int(index), self.num_steps - 1))
        try:
            state = self.recording.state_at(int(self.steps[index]))
            lo = int(self.steps[max(0, index - LOG_CONTEXT_STEPS)])
            ctx = []
            for b in self.recording.batches(start_step=lo):
                if int(b["step"]) > int(self.steps[index]):
                    break
                ctx.append(b)
        except (ProtocolError, ValueError, OSError) as e:
            self.error.emit(f"cannot seek to step {int(self.steps[index])}: {e}")
            return
        self._state, self.index, self._iter = state, index, None
        self.model.reset_events(ctx)
        self._show()

    def seek_step(self, step: int) -> None:
        """Go to the last recorded step <= ``step``."""
        i = int(np.searchsorted(self.steps, step, side="right")) - 1
        self.seek_index(max(i, 0))

    def step_forward(self) -> None:
        if self.index + 1 < self.num_steps:
            self._advance(1)

    def step_back(self) -> None:
        self.seek_index(self.index - 1)

    def to_start(self) -> None:
        self.seek_index(0)

    def to_end(self) -> None:
        self.seek_index(self.num_steps - 1)

    # --------------------------------------------------------------- playing
    def set_speed(self, speed: float) -> None:
        self.speed = float(speed)

    def play(self) -> None:
        if not self.num_steps:
            return
        if self.index >= self.num_steps - 1:
            self.seek_index(0)
        self._clock = float(self._times[self.index])
        self._last_tick = time.monotonic()
        self._timer.start()
        self.playing_changed.emit(True)

    def pause(self) -> None:
        self._timer.stop()
        self.playing_changed.emit(False)

    def toggle(self) -> None:
        self.pause() if self.playing else self.play()

    def _tick(self) -> None:
        now = time.monotonic()
        self._clock += (now - self._last_tick) * self.speed
        self._last_tick = now
        target = int(np.searchsorted(self._times, self._clock, side="right")) - 1
        if target > self.index:
            self._advance(target - self.index)
        if self.index >= self.num_steps - 1:
            self.pause()

    def _advance(self, n: int) -> None:
        """Apply the next ``n`` batches to the current frame (no keyframe needed)."""
        if self._iter is None:
            self._iter = iter(self.recording.batches(start_step=self.step + 1))
        applied = []
        try:
            for _ in range(n):
                b = next(self._iter, None)
                if b is None:
                    break
                self._state.apply(b)  # atomic: a rejected batch leaves the frame intact
                applied.append(b)
        except (ProtocolError, ValueError, OSError) as e:
            self.pause()
            self._iter = None
            self.error.emit(f"replay stopped after step {self.step + len(applied)}: {e}")
        self.index += len(applied)
        self.model.add_events(applied)
        self._show()

    def _show(self) -> None:
        self.model.set_state(self._state)
        self.position_changed.emit(self.index)
