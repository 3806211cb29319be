"""EventStream: what the engine owns to publish and/or record its cache events.

    stream = EventStream(endpoint="tcp://127.0.0.1:5557", record_path="run.kvtrace",
                         header={"engine": cfg, "model": name},
                         snapshot_fn=cache.snapshot, engine_lock=lock)
    cache_manager.sink = stream.sink          # the cache manager emits into it
    ... each engine step (holding engine_lock, if one was given) ...
    stream.end_step(step, stats)              # closes the step's batch; never blocks
    stream.close()                            # drains, writes the recording's index

Design (no second mirror): the stream never re-applies the events it publishes. Full
states, for late joiners' snapshots and for the recording's keyframes, come from the
cache itself: ``snapshot_fn()`` (the cache manager's ``snapshot()``, i.e. ``kv_state()``
form, or ``KVState.snapshot()`` form; an independent copy) is called *on the engine
thread at a step boundary*, when the stream thread has asked for one:

- at the next ``end_step`` (the state after that step's batch, so its seq is exact);
- when the engine idles: ``serve_idle()`` from the engine thread, or, if the engine gave
  an ``engine_lock`` that it holds while it changes the cache (LLMEngine does), the
  stream thread takes the lock itself when no events wait in the sink and every batch
  handed over has been handled: the cache then equals the state after the last batch.

The stream thread turns that into the wire snapshot (adding what the cache does not keep:
prompt sizes, priorities, parents, preemption and hit counters, event counts, from a
small side table fed by the rare kinds), answers every waiting request with it and, when
one is due, writes it to the recording as a keyframe. So the engine thread pays one
cache snapshot per keyframe interval, and at most one per ``snapshot_interval_s`` for
clients however many ask (coalesced; see ``publisher`` for the other bounds on clients),
never a per-event apply.

Without ``snapshot_fn`` snapshot requests are refused (the subscriber retries), and the
recording gets its starting keyframe only. After dropped batches (queue full) the next
``end_step`` attaches a snapshot (a resync): the recording takes a keyframe there and
resumes; without ``snapshot_fn`` it stops taking batches (it stays readable up to the
drop).

Batch consumers (``add_consumer``): callables run on the stream thread with each batch
handed over, in seq order, before it is encoded; the place for translators of the stream
into other formats (see ``BatchConsumer``).

The recording never stops the live stream: a write that fails (disk full, I/O error)
stops the recording alone (the file keeps its whole frames, readable without its
index), logs one error, sets ``recording_error`` (in ``stats`` and, as
``StepStats.recording_error``, in every later batch's stats, where the inspector's
banner reads it); publishing and consumers go on.

Off (no endpoint and no record_path): ``sink`` is a NullSink (``enabled`` False), no
thread, no socket; ``end_step`` returns at once.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import msgspec

from kvscope.engine.events import schema as S
from kvscope.engine.events.column_sink import ColumnSink, RecordedStep
from kvscope.engine.events.schema import ProtocolError
from kvscope.engine.events.sink import EventSink, NullSink
from kvscope.engine.events.state import KVState
from kvscope.engine.events.stats import StepStats
from kvscope.engine.events.wire import codec as C
from kvscope.engine.events.wire.publisher import Publisher
from kvscope.engine.events.wire.recording import RecordingWriter

log = logging.getLogger(__name__)

SnapshotFn = Callable[[], dict[str, Any]]


class StreamStats(msgspec.Struct, kw_only=True, frozen=True):
    """The stream's own counters, read at once (``EventStream.stats``). The one a batch
    carries to subscribers, ``dropped_batches``, travels as ``StepStats.dropped_batches``."""

    epoch: str
    seq: int  # the last batch handed over (dropped ones included)
    dropped_batches: int  # batches dropped because the stream thread's queue was full
    queue_depth: int  # batches waiting for the stream thread
    snapshots_taken: int  # cache snapshots the engine thread took for the stream
    recording_ok: bool  # False from a drop until the next keyframe (resync)
    consumer_errors: int  # batch consumers that raised
    snapshots_served: int  # snapshot replies sent to clients
    replays_served: int  # replay requests answered in full
    request_errors: int  # malformed or refused requests
    requests_received: int
    replays_refused: int  # over the replay budget
    replies_dropped: int  # replies lost to a client that stopped reading
    bytes_recorded: int
    recording_error: str = ""  # why the recording stopped early ("": it did not)


class BatchConsumer(Protocol):
    """Called on the stream thread with every batch handed to the stream, in seq order
    (a dropped batch shows as a seq gap). The batch is the published message (``v``,
    ``epoch``, ``seq``, ``step``, ``time``, ``events``, ``stats``) with id lists still
    Python lists (packing happens after the consumers). Must not mutate it, must not
    block; an exception is logged and counted (``consumer_errors``), the consumer stays."""

    def __call__(self, batch: dict[str, Any]) -> None: ...


class EventStream:
    """Engine-side event stream: a sink, one batch per step, a publisher/recorder thread.

    Thread contract: ``sink.emit``, ``end_step`` and ``serve_idle`` are called from the
    engine thread only; everything else (encoding, sockets, the file, turning cache
    snapshots into wire snapshots) happens on the stream's own thread. ``end_step`` never
    blocks: when the bounded queue is full the batch is dropped and counted
    (``dropped_batches``, and ``StepStats.dropped_batches`` in every later batch's
    stats), the next batch handed over comes with a cache snapshot (a resync: the
    recording's keyframe, the answer to subscribers' snapshot requests), and subscribers
    see the seq gap and the grown count, and take that snapshot.
    """

    def __init__(self, endpoint: str | None = None, record_path: str | None = None, *,
                 snapshot_endpoint: str | None = None, header: dict[str, Any] | None = None,
                 snapshot_fn: SnapshotFn | None = None,
                 engine_lock: threading.Lock | threading.RLock | None = None,
                 queue_size: int = 1024, replay_size: int = 4096, heartbeat_s: float = 1.0,
                 keyframe_every_steps: int = 200, keyframe_every_s: float = 10.0,
                 snapshot_interval_s: float = 1.0, sndhwm: int = 10_000,
                 consumers: list[Any] | None = None, keys: Any = None) -> None:
        # keys: CURVE keys for the publisher (a key directory or a ServerKeys,
        # engine.events.wire.keys); without them a non-local endpoint is refused.
        # consumers: other listeners of each closed batch with ``on_batch(batch)`` (a
        # BatchConsumer, on the stream thread) and ``close()`` (when the stream closes),
        # e.g. engine.events.vllm.VllmPublisher.
        self.consumers = list(consumers or ())
        self.enabled = endpoint is not None or record_path is not None or bool(self.consumers)
        # the engine thread records into columns (no map per block operation); the stream
        # thread turns each RecordedStep into the batch's events (and columns)
        self.sink: EventSink = ColumnSink() if self.enabled else NullSink()
        if any(getattr(c, "needs_store_detail", False) for c in self.consumers):
            self.sink.store_detail = True  # type: ignore[attr-defined]
        self.epoch = secrets.token_hex(8)
        self.seq = 0  # seq of the last batch handed over (assigned even if dropped)
        self.dropped_batches = 0
        self.snapshot_fn = snapshot_fn
        self.engine_lock = engine_lock
        self.snapshots_taken = 0  # cache snapshots the engine side produced
        self.consumer_errors = 0
        self._consumers: list[BatchConsumer] = [c.on_batch for c in self.consumers]
        self._need_resync = False
        # snapshot requests: the stream thread bumps _snap_wanted, whoever takes the
        # snapshot (engine thread, or stream thread under engine_lock) copies it over
        self._snap_wanted = 0
        self._snap_taken = 0
        # at most one snapshot per interval for clients' requests, however many ask (a
        # client asking in a loop must not make the engine snapshot every step). 1 s:
        # a 64k-block cache's snapshot costs the engine ~9 ms (dev box), so a flood costs
        # it <1%; a joiner waits at most 1 s, under the subscriber's 2 s request timeout
        self.snapshot_interval_s = snapshot_interval_s
        self._last_asked_for_clients = -float("inf")  # monotonic
        self._last_meta: tuple[int, float, dict[str, Any]] = (-1, 0.0, {})
        self._recording_ok = True
        # set once (stream thread) when a recording write failed; the recording is over
        self.recording_error: str | None = None
        self._bytes_recorded = 0  # what a recording that stopped early had written
        self.keyframe_every_steps = keyframe_every_steps
        self._steps_since_key = 0  # engine thread: end_steps since the last keyframe
        self._last_seq_handled = 0  # written by the stream thread only
        self._last_enqueued = 0
        self._extras: dict[str, list[Any]] = {}  # stream thread: see _note_extras
        self._kind_counts: dict[str, int] = {}
        # a SimpleQueue (C: its put wakes the stream thread without a Python-level
        # Condition, ~3x cheaper on the engine thread than queue.Queue's), bounded by
        # hand: only the engine thread puts, so qsize() < queue_size before a put holds
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.queue_size = queue_size
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.publisher: Publisher | None = None
        self.recorder: RecordingWriter | None = None
        if not self.enabled:
            return
        if endpoint is not None:
            self.publisher = Publisher(endpoint, snapshot_endpoint, self.epoch,
                                       replay_size=replay_size, heartbeat_s=heartbeat_s,
                                       sndhwm=sndhwm, info=header, keys=keys)
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
            self.recorder.keyframe(KVState(), 0, self.epoch)  # the empty starting state
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

    def add_consumer(self, consumer: BatchConsumer) -> None:
        """Run ``consumer(batch)`` on the stream thread for every later batch."""
        self._consumers = [*self._consumers, consumer]

    def end_step(self, step: int, stats: dict[str, Any] | None = None) -> None:
        """Close this step's batch (the events emitted since the last call) and hand it
        to the stream thread. Costs a dict copy and a queue put; never blocks (the
        stream thread builds the batch message). Takes a cache snapshot
        (``snapshot_fn``) only when the stream thread asked for one."""
        if not self.enabled:
            return
        events = self.sink.drain()  # type: ignore[attr-defined]
        self.seq += 1
        stats = dict(stats) if stats else {}  # a StepStats map (engine.events.stats)
        stats[_DROPPED] = self.dropped_batches
        if self.recording_error is not None:
            stats[_RECORDING_ERROR] = self.recording_error
        self._last_meta = (step, time.time(), stats)
        snap, wanted = None, self._snap_wanted
        self._steps_since_key += 1
        # keyframes every N steps are decided here, so a recording's keyframe steps do
        # not depend on how far the stream thread lags
        key = self.recorder is not None and self._steps_since_key >= self.keyframe_every_steps
        if (self._need_resync or key or wanted != self._snap_taken) and \
                self.snapshot_fn is not None:
            snap = self.snapshot_fn()  # state after this step: consistent with batch
        if self._queue.qsize() >= self.queue_size:
            self.dropped_batches += 1
            self._need_resync = True
            return
        self._queue.put_nowait((events, snap, self.seq, self._last_meta, key))
        self._last_enqueued = self.seq
        if snap is not None:
            self._need_resync = False
            self._snap_taken = wanted
            self._steps_since_key = 0
            self.snapshots_taken += 1

    def serve_idle(self) -> bool:
        """Engine thread, between steps, with nothing to run: answer a pending snapshot
        request now instead of at the next step. True if a snapshot was taken."""
        if (not self.enabled or self.snapshot_fn is None or self._need_resync
                or self._snap_wanted == self._snap_taken or self.sink.events):  # type: ignore[attr-defined]
            return False
        wanted = self._snap_wanted
        if self._queue.qsize() >= self.queue_size:
            return False
        self._queue.put_nowait((None, self.snapshot_fn(), self.seq, self._last_meta, False))
        self._snap_taken = wanted
        self.snapshots_taken += 1
        return True

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until the stream thread has handled every batch handed over so far (for
        tests and benchmarks; the engine never needs to). False on timeout."""
        end = time.monotonic() + timeout
        # dropped batches never reach the thread: wait for the last one that was queued
        while self._thread is not None and (self._last_seq_handled < self._last_enqueued
                                            or self._queue.qsize()):
            if time.monotonic() > end:
                return False
            time.sleep(0.0002)
        return True

    def close(self, timeout: float = 120.0) -> None:
        """Publish/record what is queued, close the recording (index) and the sockets.

        ``timeout`` is a hang guard only: the queue is drained whatever the box's speed
        (at 10 s a loaded box's recording lost its last steps)."""
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
    def kind_counts(self) -> dict[str, int]:
        """Events handed over so far, by kind (counted on the stream thread)."""
        return dict(self._kind_counts)

    @property
    def stats(self) -> StreamStats:
        p, r = self.publisher, self.recorder
        return StreamStats(
            epoch=self.epoch, seq=self.seq, dropped_batches=self.dropped_batches,
            queue_depth=self._queue.qsize(), snapshots_taken=self.snapshots_taken,
            recording_ok=self._recording_ok, consumer_errors=self.consumer_errors,
            snapshots_served=p.snapshots_served if p else 0,
            replays_served=p.replays_served if p else 0,
            request_errors=p.request_errors if p else 0,
            requests_received=p.requests_received if p else 0,
            replays_refused=p.replays_refused if p else 0,
            replies_dropped=p.replies_dropped if p else 0,
            bytes_recorded=r.bytes_written if r else self._bytes_recorded,
            recording_error=self.recording_error or "")

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
                    waiting = self.publisher.serve_requests(
                        can_snapshot=self.snapshot_fn is not None)
                    if waiting:
                        self._want_snapshot_for_clients()
                    self.publisher.heartbeat_if_idle()
                if self.recorder is not None and self._recording_ok and \
                        self.recorder.keyframe_due_by_time and self._last_seq_handled:
                    self._want_snapshot()
                if item is None:
                    self._snapshot_if_engine_idle()
                    if self.recorder is not None and self._recording_ok:
                        self._record(self.recorder.flush_if_stale)
        except Exception:
            log.exception("event stream thread failed; events are no longer published")
        finally:
            for consumer in self.consumers:
                try:
                    consumer.close()
                except Exception:  # noqa: BLE001 - the others still close
                    log.exception("event batch consumer %r failed to close", consumer)
            if self.recorder is not None:
                self._record(self.recorder.close)
            if self.publisher is not None:
                self.publisher.close()

    def _record(self, write: Callable[..., None], *args: Any) -> None:
        """Run one recording write; a failure (disk full, I/O error) ends the recording
        alone, loudly, once: the live stream and the consumers go on."""
        rec = self.recorder
        try:
            write(*args)
        except OSError as e:
            self.recorder = None  # nothing more is recorded (the writer closed its file)
            self._bytes_recorded = rec.bytes_written if rec is not None else 0
            self.recording_error = str(e.strerror or e)  # "No space left on device"
            log.error("recording to %s stopped: %s; the live event stream goes on (the file "
                      "is readable up to its last whole frame)",
                      rec.path if rec is not None else "?", e)

    def _want_snapshot_for_clients(self) -> None:
        """Coalesce: requests that arrive within ``snapshot_interval_s`` of the last
        snapshot asked for clients wait for the next one (all waiters share it)."""
        now = time.monotonic()
        if now - self._last_asked_for_clients < self.snapshot_interval_s:
            return
        if self._snap_wanted == self._snap_taken:
            self._last_asked_for_clients = now
        self._want_snapshot()

    def _want_snapshot(self) -> None:
        if self.snapshot_fn is not None and self._snap_wanted == self._snap_taken:
            self._snap_wanted += 1

    def _snapshot_if_engine_idle(self) -> None:
        """Take the snapshot here when the engine holds no lock and nothing is in flight:
        the cache then equals the state after batch ``self.seq``."""
        lock = self.engine_lock
        if lock is None or self.snapshot_fn is None or self._snap_wanted == self._snap_taken:
            return
        if not lock.acquire(blocking=False):
            return
        try:
            if (self.sink.events or self._need_resync  # type: ignore[attr-defined]
                    or self._queue.qsize() or self._last_seq_handled != self._last_enqueued
                    or self._snap_wanted == self._snap_taken):
                return
            wanted, seq, meta = self._snap_wanted, self.seq, self._last_meta
            snap = self.snapshot_fn()
            self._snap_taken = wanted
            self.snapshots_taken += 1
        finally:
            lock.release()
        self._handle(None, snap, seq, meta, False)

    def _handle(self, events: Any, snap: dict[str, Any] | None,
                seq: int, meta: tuple[int, float, dict[str, Any]], key: bool) -> None:
        """One queue item: a step's events (None: none; a ColumnSink's RecordedStep or
        a list of maps), closed by ``end_step`` as batch ``seq`` at ``meta`` (step, time,
        stats), made a batch here, published and recorded; and/or a cache snapshot taken
        right after batch ``seq`` (answers waiting requests; a keyframe when ``key`` or
        when one is due)."""
        batch = None if events is None else C.make_batch(self.epoch, seq, meta[0], meta[1],
                                                          events, meta[2])
        rec = self.recorder
        if batch is not None:
            recorded, packed = batch["events"], False
            if type(recorded) is RecordedStep:
                self._note_recorded(recorded)
                packed = _unpack_recorded(batch, recorded, need_events=bool(self._consumers))
            else:
                self._note_extras(batch["events"])
            if batch["seq"] != self._last_seq_handled + 1:
                if self._recording_ok and rec is not None and snap is None:
                    log.warning("event stream dropped batches before seq %d; the recording "
                                "pauses until a snapshot", batch["seq"])
                self._recording_ok = False
            for consumer in self._consumers:
                try:
                    consumer(batch)
                except Exception:  # noqa: BLE001 - a consumer must not stop the stream
                    self.consumer_errors += 1
                    log.exception("event batch consumer %r failed", consumer)
            if not packed:
                C.pack_events(batch["events"])
            payload = self._codec.encode(batch)  # bulk steps as columns (protocol 3)
            if self.publisher is not None:
                self.publisher.publish(batch["seq"], payload)
            self._last_seq_handled = batch["seq"]
            if rec is not None and self._recording_ok:
                self._record(rec.add, batch, None, payload)
        if snap is None:
            return
        try:
            wire = self._wire_snapshot(snap, meta)
        except ProtocolError as e:
            log.error("the engine's snapshot is malformed: %s", e)
            return
        if self.publisher is not None:
            self.publisher.answer_snapshots(seq, wire)
        rec = self.recorder  # None if the batch's write just failed
        if rec is not None and (key or not self._recording_ok or rec.keyframe_due):
            self._record(rec.keyframe, wire, seq, self.epoch)  # after the batch's delta
            self._recording_ok = True  # a resync point

    def _wire_snapshot(self, snap: dict[str, Any],
                       meta: tuple[int, float, dict[str, Any]]) -> dict[str, Any]:
        """A cache snapshot (``kv_state()`` or ``KVState.snapshot()`` form) as the wire
        snapshot, with the side table's extras and the batch's step, time and stats."""
        st = KVState.from_snapshot(snap) if "v" in snap else KVState.from_canonical(snap)
        for sid, s in st.seqs.items():
            extra = self._extras.get(sid)
            if extra is not None:
                s.prompt_tokens, s.priority, s.parent, s.preemptions, s.hit_tokens = extra
        st.kind_counts = dict(self._kind_counts)
        st.step, st.time, st.stats = meta
        return st.snapshot()

    def _note_recorded(self, recorded: RecordedStep) -> None:
        """``_note_extras`` over a ColumnSink's rows (typed rows stay tuples: see
        ``ColumnSink`` for their layout)."""
        counts, extras = self._kind_counts, self._extras
        for row in recorded.rows:
            kind = row[0]
            if kind is None:  # an emitted map
                self._note_extras((row[1],))
                continue
            counts[kind] = counts.get(kind, 0) + 1
            if kind not in _EXTRA_KINDS:
                continue
            if kind == S.HIT:
                if row[2] in extras:
                    extras[row[2]][4] += row[3]
            elif kind == S.SEQ_ADD:  # (kind, seq, prompt_tokens, priority): no parent
                extras[row[1]] = [row[2], row[3], None, 0, 0]
            elif kind == S.SEQ_FINISH:
                extras.pop(row[1], None)

    def _note_extras(self, events: Iterable[dict[str, Any]]) -> None:
        """Per-sequence facts a cache snapshot lacks, from the few kinds that change them
        (a dict lookup per event; never a replay of the page table)."""
        counts, extras = self._kind_counts, self._extras
        for ev in events:
            kind = ev.get("kind")
            counts[kind] = counts.get(kind, 0) + 1
            if kind not in _EXTRA_KINDS:
                continue
            sid = ev.get("seq")
            if kind == S.SEQ_ADD:
                extras[sid] = [ev.get("prompt_tokens", 0), ev.get("priority", 0),
                               ev.get("parent"), 0, 0]
            elif sid in extras:
                if kind == S.SEQ_FINISH:
                    del extras[sid]
                elif kind == S.SEQ_PREEMPT:
                    extras[sid][3] += 1
                else:  # hit, host_hit
                    extras[sid][4] += int(ev.get("tokens", 0))


def _unpack_recorded(batch: dict[str, Any], recorded: RecordedStep,
                     need_events: bool) -> bool:
    """A batch whose ``events`` are a ColumnSink's ``RecordedStep``, in place, as the wire
    takes it: a bulk step as ``columns`` (built from the rows: no map per block
    operation) with ``events`` the maps the columns do not hold, unless ``need_events``
    (consumers read the whole step: then ``events`` is every map, as ``ListSink`` gives
    them); any other step as its ``events``, already packed (``pack_events``' form,
    built so from the rows) when no consumer reads them. True when packed."""
    if not recorded.worth_columns():
        if need_events:
            batch["events"] = recorded.events()
            return False
        batch["events"] = recorded.events(packed=True)
        C.pack_events([row[1] for row in recorded.rows if row[0] is None])
        return True
    cols = batch["columns"] = recorded.columns(with_events=need_events)
    batch["events"] = cols.source if need_events else cols.others
    return False


_DROPPED = "dropped_batches"  # StepStats.dropped_batches: the stream's own counter
assert _DROPPED in StepStats.__struct_fields__
_RECORDING_ERROR = "recording_error"  # StepStats.recording_error: set once it stopped
assert _RECORDING_ERROR in StepStats.__struct_fields__
_EXTRA_KINDS = frozenset((S.SEQ_ADD, S.SEQ_FINISH, S.SEQ_PREEMPT, S.HIT, S.HOST_HIT))


def open_stream(endpoint: str | None, record_path: str | None, kv_events_config: str | None,
                header: dict[str, Any], engine_lock: Any,
                keys: str | None = None) -> EventStream | None:
    """The engine's event stream: publishing on ``endpoint``, recording to ``record_path``
    and/or vLLM-format KV events (``kv_events_config``, vLLM's JSON); None when none is
    asked for; ``keys``: the CURVE key directory for ``endpoint``. A consumer opened
    before a failing stream is closed again."""
    from kvscope.engine.events.vllm.config import KVEventsConfig

    vllm_events = KVEventsConfig.from_json(kv_events_config or "{}")
    if not (endpoint or record_path or vllm_events.enabled):
        return None
    consumers = []
    if vllm_events.enabled:
        from kvscope.engine.events.vllm.kv_events_publisher import VllmPublisher

        consumers.append(VllmPublisher(vllm_events))
    try:
        return EventStream(endpoint=endpoint, record_path=record_path, header=header,
                           engine_lock=engine_lock, consumers=consumers, keys=keys)
    except BaseException:
        for consumer in consumers:
            consumer.close()
        raise
