"""LiveSource: a running engine's event stream into the InspectorModel.

Threads: the ``engine.events.Subscriber`` runs on its own thread; it owns the sockets,
decodes, and applies every batch to its KVState mirror (under ``sub.lock``). Its
callback only queues the updates (bounded). A 30 Hz QTimer on the GUI thread takes what
is queued, clones the mirror once under the lock and hands that frame to the model, so
the GUI does O(frame) work per tick however fast the engine publishes, and keeps
drawing the last frame when the engine dies. Late join, gaps and publisher restarts are
the Subscriber's job (snapshot + replay); this class only reports them.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import zmq
from PySide6.QtCore import QObject, QTimer, Signal

from kvscope.engine.events import ProtocolError
from kvscope.engine.events.analysis.lifecycle import LifecycleIndex
from kvscope.engine.events.wire import Codec, Subscriber
from kvscope.inspector.errors import InspectError
from kvscope.inspector.model import InspectorModel

TICK_MS = 33  # ~30 Hz
MAX_QUEUED = 20_000  # batches held for the GUI; beyond this the oldest are skipped
MAX_LOG_EVENTS_PER_TICK = 500  # the log shows the newest; older ones of a flood are skipped
NO_ANSWER_S = 3.0  # "nobody is publishing there" after this long without a snapshot


class _ReportingCodec(Codec):
    """The subscriber's codec, remembering the last decode error's text for the banner
    (the Subscriber counts malformed messages; the user wants to know why)."""

    last_error: str = ""

    def decode(self, data: bytes) -> dict[str, Any]:
        try:
            return super().decode(data)
        except ProtocolError as e:
            self.last_error = str(e)
            raise


def _keep_joined_state(update: dict[str, Any], state: Any) -> None:
    """Subscriber hook (its thread): a snapshot update carries a copy of the state it set,
    so the lifecycle index can adopt the sequences that existed before it joined."""
    if update.get("type") == "snapshot":
        update["joined_state"] = state.clone()


class LiveSource(QObject):
    status_changed = Signal(dict)  # the fields of status_fields()
    problem = Signal(str)  # "" when all is well
    engine_info = Signal(object)  # the publisher's header (engine, model) when it changes

    def __init__(self, endpoint: str, model: InspectorModel,
                 snapshot_endpoint: str | None = None, keys: str | None = None) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.model = model
        try:
            self.sub = Subscriber(endpoint, snapshot_endpoint, keys=keys)
        except (ValueError, zmq.ZMQError) as e:  # KeysError is a ValueError
            raise InspectError(f"cannot connect to {endpoint!r}: {e}") from None
        self.sub.codec = _ReportingCodec(self.sub.codec.max_bytes)
        self.sub.on_apply = _keep_joined_state
        self._lock = threading.Lock()
        self._queued: deque[dict[str, Any]] = deque(maxlen=MAX_QUEUED)
        self._dirty = False
        self.skipped = 0  # batches queued for the GUI but skipped (log/timeline only)
        self.has_state = False
        self._started_at = 0.0
        self._last_problem = ""
        self.info: dict[str, Any] = {}  # the publisher's header, from its last snapshot
        self._timer = QTimer(self)
        self._timer.setInterval(TICK_MS)
        self._timer.timeout.connect(self.tick)

    def start(self) -> None:
        self._started_at = time.monotonic()
        self.sub.start(self._on_updates)
        self._timer.start()

    def stop(self) -> None:
        self._timer.stop()
        self.sub.close()

    # ---------------------------------------------------- subscriber thread
    def _on_updates(self, updates: list[dict[str, Any]]) -> None:
        with self._lock:
            overflow = len(self._queued) + len(updates) - MAX_QUEUED
            if overflow > 0:
                self.skipped += overflow
            self._queued.extend(updates)
            self._dirty = True

    # ----------------------------------------------------------- GUI thread
    def tick(self) -> None:
        """Apply what arrived since the last tick (coalesced) and refresh the status."""
        with self._lock:
            updates, dirty = list(self._queued), self._dirty
            self._queued.clear()
            self._dirty = False
        if dirty:
            with self.sub.lock:
                # unchanged tiers are shared with the frame on screen (never mutated)
                frame = self.sub.state.clone(reuse=self.model.state)
            tl = self.model.timeline
            batches = []
            for u in updates:
                if u.get("type") == "snapshot":
                    # A (re)sync: a restarted engine counts steps from 0 again.
                    if tl.n and tl.col("step")[-1] >= u["step"]:
                        tl.truncate_after(u["step"] - 1)
                        self.model.lifecycle = LifecycleIndex()
                    if "joined_state" in u:  # sequences already there when we (re)joined
                        self.model.lifecycle.adopt(u["joined_state"])
                    info = u.get("info")
                    if isinstance(info, dict) and info != self.info:
                        self.info = info
                        self.engine_info.emit(info)
                    continue
                batches.append(u)
                if tl.n and tl.col("step")[-1] >= u["step"]:
                    tl.truncate_after(u["step"] - 1)
                tl.append(u)
                self.model.lifecycle.add(u)
            self.has_state = True
            self.model.set_state(frame)
            self.model.timeline_changed.emit()
            self.model.add_events(_tail_events(batches, MAX_LOG_EVENTS_PER_TICK))
        self.status_changed.emit(self.status_fields())
        problem = self._problem()
        if problem != self._last_problem:
            self._last_problem = problem
            self.problem.emit(problem)

    def status_fields(self) -> dict[str, str]:
        s = self.sub
        state = s.status
        return {
            "source": f"<b>live</b> {state}",
            "epoch": f"epoch {s.epoch or '—'}",
            "seq": f"seq {s.last_seq:,}",
            "loss": f"gaps {s.gaps} · drops {s.publisher_dropped} · restarts {s.restarts}"
                    + (f" · errors {s.errors}" if s.errors else ""),
            "rate": f"{s.events_per_s:,.0f} ev/s",
            "position": f"step {self.model.state.step:,}",
        }

    def status_text(self) -> str:
        f = self.status_fields()
        return " · ".join(v.replace("<b>", "").replace("</b>", "") for v in f.values())

    def _problem(self) -> str:
        s = self.sub
        codec: Any = s.codec
        if s.status == "waiting":
            if s.problem:  # a failed security handshake: says which side to fix
                return s.problem
            if codec.last_error:
                return f"{self.endpoint}: messages rejected: {codec.last_error}"
            if time.monotonic() - self._started_at > NO_ANSWER_S:
                return (f"no kvscope publisher answering at {self.endpoint} "
                        f"(snapshot from {s.snapshot_endpoint}); still trying")
            return ""
        if s.status == "stale":
            return (f"{self.endpoint} went silent (engine stopped?); showing its last state, "
                    "reconnecting when it returns")
        if s.publisher_recording_error:
            return (f"the engine's recording stopped early ({s.publisher_recording_error}); "
                    "the live stream goes on")
        return ""


def _tail_events(batches: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """The last batches holding at most ``limit`` events (the log shows the newest)."""
    out, n = [], 0
    for b in reversed(batches):
        n += len(b.get("events", ()))
        if n > limit and out:
            break
        out.append(b)
    return out[::-1]
