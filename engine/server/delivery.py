"""StepDelivery: the engine thread's outputs handed to the asyncio loop, one wake-up per
burst (an engine step's outputs for every stream) instead of one per output.

Each ``call_soon_threadsafe`` writes the loop's self-pipe and may wake it once more, and
every wake-up takes the GIL from the engine thread in the middle of its next forward pass.
The engine thread delivers a step's outputs back to back, so the first delivery of a step
schedules one flush and the others join it.

Invariant: every delivered item reaches its queue, in delivery order per queue: a flush is
scheduled exactly when an item is appended to an empty pending list, and the flush takes
the whole list.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


class StepDelivery:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pending: list[tuple[asyncio.Queue, Any]] = []
        self._lock = threading.Lock()

    def to(self, queue: asyncio.Queue) -> Callable[[Any], None]:
        """The ``deliver`` callback (engine thread) of one request's queue."""
        def deliver(item: Any) -> None:
            with self._lock:
                self._pending.append((queue, item))
                if len(self._pending) > 1:
                    return  # a flush is scheduled and will take this item too
            try:
                self.loop.call_soon_threadsafe(self._flush)
            except RuntimeError:
                pass  # the event loop is gone (shutdown); nobody is waiting any more
        return deliver

    def _flush(self) -> None:  # asyncio thread
        with self._lock:
            batch, self._pending = self._pending, []
        for queue, item in batch:
            queue.put_nowait(item)
