"""EventStream: what the engine owns to publish and/or record its cache events.

    stream = EventStream(endpoint="tcp://127.0.0.1:5557", record_path="run.kvtrace",
                         header={"engine": cfg, "model": name}, snapshot_fn=snap)
    cache_manager.sink = stream.sink          # the cache manager emits into it
    ... each engine step ...
    stream.end_step(step, stats)              # closes the step's batch; never blocks
    stream.close()                            # drains, writes the recording's index

Design (why a mirror): the stream keeps its OWN ``KVState`` mirror, applying each batch
it publishes, on its background thread. A snapshot for a late joiner is then the mirror
*between* two batches, so its seq is exactly the last batch it includes, with no lock
against the engine thread, and an idle engine can still serve joiners; the recorder's
keyframes come from the same mirror, and a batch the mirror rejects (an engine bug) is
counted in ``mirror_errors``. The price: applying every batch costs about what a
subscriber pays, on the stream thread, which under the GIL still competes with the
engine's Python code (docs/BENCHMARKS.md, "Event stream", has the numbers).

``snapshot_fn`` (optional, also settable later as ``stream.snapshot_fn``; returns
``KVState.snapshot()`` form; from the cache manager's canonical ``snapshot()`` use
``KVState.from_canonical(manager.snapshot()).snapshot()``) is called only after
batches were dropped, on the engine thread at the next ``end_step`` (a step boundary,
so it is consistent), to re-seed the mirror (the recording gets a keyframe there).
Without it, a drop leaves the mirror stale for good: snapshot requests are refused and
the recording stops taking batches (it stays readable up to the drop).

Off (no endpoint and no record_path): ``sink`` is a NullSink (``enabled`` False), no
thread, no socket; ``end_step`` returns at once.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from typing import Any

from engine.events import codec as C
from engine.events.publisher import Publisher
from engine.events.recording import RecordingWriter
from engine.events.schema import ProtocolError
from engine.events.sink import EventSink, ListSink, NullSink
from engine.events.state import KVState

log = logging.getLogger(__name__)

SnapshotFn = Any  # Callable[[], dict[str, Any]]; kept loose for the engine's lambdas


class EventStream:
    """Engine-side event stream: a sink, one batch per step, a publisher/recorder thread.

    Thread contract: ``sink.emit`` and ``end_step`` are called from the engine thread
    only; everything else (encoding, the mirror, sockets, the file) happens on the
    stream's own thread. ``end_step`` never blocks: when the bounded queue is full the
    batch is dropped and counted (``dropped_batches``, and ``stats["dropped_batches"]`` in
    every later batch), and subscribers see the seq gap.
    """

    def __init__(self, endpoint: str | None = None, record_path: str | None = None, *,
                 snapshot_endpoint: str | None = None, header: dict[str, Any] | None = None,
                 snapshot_fn: SnapshotFn | None = None, queue_size: int = 1024,
                 replay_size: int = 4096, heartbeat_s: float = 1.0,
                 keyframe_every_steps: int = 200, keyframe_every_s: float = 10.0,
                 consumers: list[Any] | None = None) -> None:
        # consumers: other listeners of each closed batch (the in-memory dict, read only),
        # e.g. engine.events.vllm.VllmPublisher: ``on_batch(batch)`` on the stream thread,
        # ``close()`` when the stream closes.
        self.consumers = list(consumers or ())
        self.enabled = endpoint is not None or record_path is not None or bool(self.consumers)
        self.sink: EventSink = ListSink() if self.enabled else NullSink()
        if any(getattr(c, "needs_store_detail", False) for c in self.consumers):
            self.sink.store_detail = True  # type: ignore[attr-defined]
        self.epoch = secrets.token_hex(8)
        self.seq = 0  # seq of the last batch handed over (assigned even if dropped)
        self.dropped_batches = 0
        self.mirror_errors = 0
        self.mirror = KVState()  # owned by the stream thread once started
        self.snapshot_fn = snapshot_fn
        self._need_resync = False
        self._mirror_ok = True
        self._last_seq_handled = 0  # written by the stream thread only
        self._last_enqueued = 0
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.publisher: Publisher | None = None
        self.recorder: RecordingWriter | None = None
        if not self.enabled:
            return
        if endpoint is not None:
            self.publisher = Publisher(endpoint, snapshot_endpoint, self.epoch,
                                       replay_size=replay_size, heartbeat_s=heartbeat_s,
                                       info=header)
        if record_path is not None:
            try:
                self.recorder = RecordingWriter(
                    record_path, {**(header or {}), "epoch": self.epoch},
                    keyframe_every_steps=keyframe_every_steps,
                    keyframe_every_s=keyframe_every_s)
            except BaseException:
                if self.publisher is not None:
                    self.publisher.close()
                raise
            self.recorder.keyframe(self.mirror, 0, self.epoch)  # the empty starting state
        self._codec = C.Codec()
        self._thread = threading.Thread(target=self._run, name="kvscope-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ engine thread
    @property
    def endpoint(self) -> str | None:
        """The bound PUB endpoint (with the real port when ``:0`` or ``:*`` was asked)."""
        return self.publisher.endpoint if self.publisher else None

    @property
    def snapshot_endpoint(self) -> str | None:
        return self.publisher.snapshot_endpoint if self.publisher else None

    def end_step(self, step: int, stats: dict[str, Any] | None = None) -> None:
        """Close this step's batch (the events emitted since the last call) and hand it
        to the stream thread. Costs a dict and a queue put; never blocks."""
        if not self.enabled:
            return
        events = self.sink.drain()  # type: ignore[attr-defined]
        self.seq += 1
        stats = dict(stats) if stats else {}
        stats["dropped_batches"] = self.dropped_batches
        batch = C.make_batch(self.epoch, self.seq, step, time.time(), events, stats)
        resync = None
        if self._need_resync and self.snapshot_fn is not None:
            resync = self.snapshot_fn()  # state after this step: consistent with batch
        try:
            self._queue.put_nowait((batch, resync))
        except queue.Full:
            self.dropped_batches += 1
            self._need_resync = True
            return
        self._last_enqueued = self.seq
        if resync is not None:
            self._need_resync = False

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until the stream thread has handled every batch handed over so far (for
        tests and benchmarks; the engine never needs to). False on timeout."""
        end = time.monotonic() + timeout
        # dropped batches never reach the thread: wait for the last one that was queued
        while self._thread is not None and self._last_seq_handled < self._last_enqueued:
            if time.monotonic() > end:
                return False
            time.sleep(0.0002)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Publish/record what is queued, close the recording (index) and the sockets."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("event stream thread did not stop within %.1f s", timeout)
        self._thread = None

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def stats(self) -> dict[str, Any]:
        p, r = self.publisher, self.recorder
        return {
            "epoch": self.epoch, "seq": self.seq, "dropped_batches": self.dropped_batches,
            "queue_depth": self._queue.qsize(), "mirror_errors": self.mirror_errors,
            "mirror_ok": self._mirror_ok,
            "snapshots_served": p.snapshots_served if p else 0,
            "replays_served": p.replays_served if p else 0,
            "request_errors": p.request_errors if p else 0,
            "bytes_recorded": r.bytes_written if r else 0,
        }

    # ------------------------------------------------------------ stream thread
    def _run(self) -> None:
        try:
            while True:
                try:
                    item = self._queue.get(timeout=0.02)
                except queue.Empty:
                    item = None
                    if self._stop.is_set():
                        break
                if item is not None:
                    self._handle(*item)
                if self.publisher is not None:
                    self.publisher.serve_requests(self._snapshot_for_request)
                    self.publisher.heartbeat_if_idle()
        except Exception:
            log.exception("event stream thread failed; events are no longer published")
        finally:
            for consumer in self.consumers:
                consumer.close()
            if self.recorder is not None:
                self.recorder.close()
            if self.publisher is not None:
                self.publisher.close()

    def _handle(self, batch: dict[str, Any], resync: dict[str, Any] | None) -> None:
        gap = batch["seq"] != self._last_seq_handled + 1
        keyframe = False
        if resync is not None:
            self.mirror = KVState.from_snapshot(resync)
            self.mirror.step, self.mirror.time = batch["step"], batch["time"]
            self.mirror.stats = batch["stats"]
            self._mirror_ok = keyframe = True
        elif gap:
            self._mirror_ok = False  # a dropped batch: the mirror cannot be trusted
            log.warning("event stream dropped batches before seq %d; mirror is stale until "
                        "resync", batch["seq"])
        elif self._mirror_ok:
            try:
                self.mirror.apply(batch)
            except ProtocolError as e:
                self.mirror_errors += 1
                self._mirror_ok = False
                log.error("engine emitted a batch its own mirror rejects (step %s): %s",
                          batch["step"], e)
        payload = self._codec.encode(batch)
        if self.publisher is not None:
            self.publisher.publish(batch["seq"], payload)
        self._last_seq_handled = batch["seq"]
        for consumer in self.consumers:
            consumer.on_batch(batch)
        if self.recorder is not None and self._mirror_ok:
            if keyframe:
                self.recorder.keyframe(self.mirror, batch["seq"], self.epoch)
            else:
                self.recorder.add(batch, self.mirror, payload)

    def _snapshot_for_request(self) -> dict[str, Any] | None:
        return self.mirror.snapshot() if self._mirror_ok else None
