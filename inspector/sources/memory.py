"""MemoryRecording: a recording held as a list of batches, with in-memory keyframes.

Same reading interface as ``engine.events`` recordings as the replay uses it (``steps``,
``state_at``, ``batches(start_step)``, ``header``), so the replay and the views can be
driven by batches made in a test or received live. Invariant: ``state_at(s)`` equals
applying every batch with step <= s to a fresh KVState, in order.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Any

from kvscope.engine.events import KVState


class MemoryRecording:
    def __init__(self, batches: list[dict[str, Any]], keyframe_every: int = 64,
                 header: dict[str, Any] | None = None) -> None:
        self._batches = list(batches)
        self.steps = [int(b["step"]) for b in self._batches]
        if any(b <= a for a, b in zip(self.steps, self.steps[1:], strict=False)):
            raise ValueError("batches are not in strictly increasing step order")
        self.header = header or {"source": "memory"}
        # Keyframes: (batch index, state after applying batch index).
        self._key_idx: list[int] = []
        self._key_state: list[KVState] = []
        st = KVState()
        for i, b in enumerate(self._batches):
            st.apply(b)
            if i % keyframe_every == 0:
                self._key_idx.append(i)
                self._key_state.append(st.clone())

    def __len__(self) -> int:
        return len(self._batches)

    def batches(self, start_step: int | None = None) -> Iterator[dict[str, Any]]:
        i = 0 if start_step is None else bisect.bisect_left(self.steps, start_step)
        yield from self._batches[i:]

    def state_at(self, step: int) -> KVState:
        """State after the last batch with step <= ``step`` (fresh state before the first)."""
        i = bisect.bisect_right(self.steps, step) - 1
        if i < 0:
            return KVState()
        k = bisect.bisect_right(self._key_idx, i) - 1
        st = self._key_state[k].clone()
        for b in self._batches[self._key_idx[k] + 1: i + 1]:
            st.apply(b)
        return st
