"""Subscriber: rebuilds a KVState from a live EventStream (the ZeroMQ Clone pattern).

    sub = Subscriber("tcp://127.0.0.1:5557")      # snapshot endpoint defaults to port+1
    while ...:
        for update in sub.poll(timeout=0.1):       # applied, in order
            ...                                    # update["type"]: "batch" | "snapshot"
        sub.state                                  # the mirror (a KVState)
    sub.close()

Or on a thread of its own (what the inspector's receiver does):

    sub.start(callback)        # callback(updates) on the subscriber's thread
    with sub.lock:             # the GUI thread reads the mirror under the lock
        codes = sub.state.block_codes("gpu")
    sub.close()

Protocol (see ``codec``): SUB is connected first, then a snapshot is requested over a
DEALER; batches that arrive meanwhile are buffered, those with seq <= the snapshot's seq
are dropped and the rest applied in seq order. A seq gap asks for a replay of the
missing batches (and falls back to a fresh snapshot when the publisher no longer has
them); a new epoch (publisher restart) or a batch the mirror rejects also leads to a
fresh snapshot. Malformed messages are counted (``errors``) and skipped.

Bounded by construction (docs/events.md, "Limits"): each message is received within
``max_bytes`` over all its frames and ``max_frames`` frames (``receive.recv_bounded``;
past them it is dropped as read), the buffer of batches waiting for a snapshot within
``max_buffered``/``max_buffered_bytes``, and the mirror within ``KVState``'s limits (total
blocks, live sequences, a snapshot's declared size). Whatever is refused for a limit
is counted in ``errors`` and its reason kept in ``refused`` (and ``problem``).

Overload is never silent: a subscriber that reads too slowly loses batches at its queue
(``rcvhwm`` messages here, the publisher's ``sndhwm`` there, beyond which ZeroMQ's PUB
drops for it alone), and a publisher whose engine outran it drops whole batches and
says so in every later batch (``StepStats.dropped_batches``). Either way the next batch
shows the gap (``gaps``); a gap the publisher says it dropped goes straight to a
snapshot, any other is replayed, or resynced from a snapshot when the replay cannot
be served (``resyncs``); the batches a snapshot covered are counted
(``skipped_batches``), and the mirror equals the publisher's cache again.

Updates: ``{"type": "batch", ...the batch}`` after each applied batch and
``{"type": "snapshot", "epoch", "seq", "step", "info"}`` after a snapshot replaced the
whole state (redraw everything; ``info`` is the publisher's header: model, engine
config). ``on_apply(update, state)``, if given, runs right after each one, before the
next is applied (the recorder uses it to keyframe the exact state).

Keys (``engine.events.wire.keys``): with ``keys`` both sockets are CURVE clients that
present this client's key and accept only a publisher holding the server key's secret.
A failed security handshake (the publisher refused our key, wants keys we lack, does
not use keys, or is not the server the keys name) never raises and never blocks: the
subscriber stays "waiting", ZeroMQ keeps retrying, and ``problem`` says what failed
(read from the sockets' monitors at each ``poll``) until a handshake succeeds.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from kvscope.engine.events.schema import ProtocolError
from kvscope.engine.events.state import KVState
from kvscope.engine.events.stats import StepStats
from kvscope.engine.events.wire import codec as C
from kvscope.engine.events.wire.keys import HOW_TO_MAKE, ClientKeys, client_keys
from kvscope.engine.events.wire.publisher import snapshot_endpoint_for
from kvscope.engine.events.wire.receive import DEFAULT_MAX_FRAMES, MessageTooLarge, recv_bounded

Update = dict[str, Any]

WAITING, CONNECTED, STALE = "waiting", "connected", "stale"
_HANDSHAKE = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
              | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class Subscriber:
    """A live KVState mirror of one publisher. Not thread-safe except as documented: after
    ``start()`` only the subscriber's thread polls; others read ``state`` under ``lock``."""

    def __init__(self, endpoint: str, snapshot_endpoint: str | None = None, *,
                 on_apply: Callable[[Update, KVState], None] | None = None,
                 stale_after_s: float = 3.0, request_timeout_s: float = 2.0,
                 max_bytes: int = C.DEFAULT_MAX_BYTES, max_frames: int = DEFAULT_MAX_FRAMES,
                 max_buffered: int = 100_000,
                 max_buffered_bytes: int = 4 * C.DEFAULT_MAX_BYTES,
                 rcvhwm: int = 100_000, rcvbuf: int = 0,
                 keys: ClientKeys | str | None = None) -> None:
        # rcvhwm (messages) and rcvbuf (the socket's kernel buffer in bytes; 0: the OS's,
        # which grows to megabytes) bound how far this subscriber may fall behind: past
        # them the publisher drops its batches and it resyncs (module docstring)
        # keys: CURVE client keys (a key directory or ClientKeys; KeysError, a
        # ValueError, when they cannot be read)
        self.keys = client_keys(keys)
        self.endpoint = endpoint
        self.snapshot_endpoint = snapshot_endpoint or snapshot_endpoint_for(endpoint)
        self.handshake_failures = 0  # failed security handshakes (either socket)
        self._handshake_problem: str | None = None
        self.state = KVState()
        self.lock = threading.Lock()
        self.codec = C.Codec(max_bytes)
        self.max_frames = max_frames
        # the last message, batch or snapshot refused for a limit or by the mirror:
        # why (None: none was)
        self.refused: str | None = None
        self.on_apply = on_apply
        self.stale_after_s = stale_after_s
        self.request_timeout_s = request_timeout_s
        self.max_buffered = max_buffered
        self.max_buffered_bytes = max_buffered_bytes
        self._buffered_bytes = 0  # encoded size of what _buffer holds (a hostile peer's
        # batches may each be max_bytes: the count alone does not bound the memory)
        # counters (read them as properties/attributes)
        self.epoch: str | None = None
        self.last_seq = 0
        self.gaps = 0  # seq gaps seen on the live stream
        self.replays = 0  # gaps filled by replay
        self.resyncs = 0  # snapshots installed after the first (gap, restart, bad batch)
        self.restarts = 0  # publisher restarts (epoch changes) seen
        self.apply_errors = 0  # well-formed batches the mirror rejected
        self.publisher_dropped = 0  # batches the publisher says it dropped
        # why the publisher's recording stopped early (None: it did not, or has none)
        self.publisher_recording_error: str | None = None
        # batches this mirror never applied one by one because a resync snapshot covered
        # them (lost on the way, or dropped by the publisher): within one epoch,
        # last_seq == the first snapshot's seq + batches_applied + skipped_batches
        self.skipped_batches = 0
        self.batches_applied = 0
        self.events_applied = 0
        # well-formed messages on the live socket (batches and heartbeats): from the first
        # one on, the subscription is in place and every later batch arrives live
        self.live_messages = 0
        # protocol state
        self._synced = False  # a snapshot has been installed for self.epoch
        self._pending_req: tuple[str, int, float] | None = None  # (type, id, sent at)
        self._ids = itertools.count(1)
        self._buffer: dict[int, tuple[dict[str, Any], int]] = {}  # seq -> (batch, bytes)
        self._last_heard = 0.0
        self._rate: collections.deque[tuple[float, int]] = collections.deque()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._dealer = self._ctx.socket(zmq.DEALER)
        for s in (self._sub, self._dealer):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.MAXMSGSIZE, max_bytes)  # hostile sizes die in libzmq
            if self.keys is not None:
                self.keys.apply(s)
        # handshake outcomes, watched from before the connects (inproc PAIR sockets)
        self._monitors = [s.get_monitor_socket(_HANDSHAKE) for s in (self._sub, self._dealer)]
        self._sub.setsockopt(zmq.RCVHWM, rcvhwm)
        if rcvbuf:
            self._sub.setsockopt(zmq.RCVBUF, rcvbuf)
        self._sub.setsockopt(zmq.SUBSCRIBE, C.TOPIC)
        self._sub.connect(endpoint)  # subscribe first ...
        self._dealer.connect(self.snapshot_endpoint)
        self._request_snapshot()  # ... then ask for the snapshot

    # ------------------------------------------------------------------ status
    @property
    def status(self) -> str:
        """"waiting" (no snapshot yet), "connected", or "stale" (silent > stale_after_s:
        the publisher sends a heartbeat every ~1 s, so silence means it is gone)."""
        if not self._synced:
            return WAITING
        return CONNECTED if time.monotonic() - self._last_heard < self.stale_after_s else STALE

    @property
    def problem(self) -> str | None:
        """Why nothing arrives: a failed security handshake (None once one succeeds),
        else the last message, batch or snapshot refused (``refused``), else None."""
        return self._handshake_problem or self.refused

    @property
    def events_per_s(self) -> float:
        """Events applied per second over the last ~2 s. Safe from another thread (a
        GUI's): it reads a copy (list() of a deque is one step under the GIL) and leaves
        the trimming to the subscriber's thread, which appends (iterating the deque
        itself while that thread appended raised "deque mutated during iteration")."""
        now = time.monotonic()
        rate = [(t, n) for t, n in list(self._rate) if now - t <= 2.0]
        if not rate:
            return 0.0
        span = max(now - rate[0][0], 0.5)
        return sum(n for _, n in rate) / span

    @property
    def errors(self) -> int:
        """Malformed messages skipped plus batches the mirror rejected."""
        return self.codec.num_errors + self.apply_errors

    # -------------------------------------------------------------------- poll
    def poll(self, timeout: float = 0.0) -> list[Update]:
        """Wait up to ``timeout`` s for messages, handle all that are waiting, and return
        the updates applied, in order."""
        updates: list[Update] = []
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._dealer, zmq.POLLIN)
        ready = dict(poller.poll(int(timeout * 1000)))
        # Replies first: a snapshot must be installed before buffered batches drain.
        # One message at a time (received, decoded, handled, dropped): at most one
        # max_bytes message is held beyond what the buffer keeps.
        if ready.get(self._dealer) or self._dealer.poll(0):
            for frames in self._received(self._dealer, 10_000):
                self._on_reply(frames, updates)
        if ready.get(self._sub) or self._sub.poll(0):
            for frames in self._received(self._sub, 10_000):
                self._on_pub(frames, updates)
        self._check_request_timeout()
        self._check_handshakes()
        return updates

    def start(self, callback: Callable[[list[Update]], None] | None = None,
              interval: float = 0.05) -> None:
        """Poll on a background thread, calling ``callback(updates)`` when non-empty."""
        if self._thread is not None:
            raise RuntimeError("subscriber already started")

        def run() -> None:
            while not self._stop.is_set():
                updates = self.poll(interval)
                if updates and callback is not None:
                    callback(updates)

        self._thread = threading.Thread(target=run, name="kvscope-subscriber", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        if not self._ctx.closed:
            for s in (self._sub, self._dealer):
                s.disable_monitor()
            for m in self._monitors:
                m.close()
            self._sub.close()
            self._dealer.close()
            self._ctx.term()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ PUB messages
    def _on_pub(self, frames: list[bytes], updates: list[Update]) -> None:
        try:
            seq, msg = self.codec.decode_frames(frames)
        except ProtocolError:
            return  # counted; a lost batch shows up as a gap at the next good one
        self._last_heard = time.monotonic()
        self.live_messages += 1
        if self._synced and msg["epoch"] != self.epoch:
            self.restarts += 1  # a new publisher: everything we hold is from the old one
            self._synced = False
            self._clear_buffer()
            self._request_snapshot()
        if msg["type"] == C.MSG_HEARTBEAT:
            if self._synced and seq > self.last_seq and self._pending_req is None:
                self.gaps += 1  # batches went missing and nothing newer came to show it
                self._request_replay()
            return
        self._buffer_batch(msg, len(frames[-1]))
        self._drain_buffer(updates)

    def _buffer_batch(self, msg: dict[str, Any], size: int) -> None:
        if self._synced and msg["seq"] <= self.last_seq:
            return
        if (len(self._buffer) >= self.max_buffered
                or self._buffered_bytes + size > self.max_buffered_bytes):
            # Too far behind to catch up by replay: start over from a snapshot.
            self._clear_buffer()
            self._synced = False
            self._request_snapshot()
        old = self._buffer.get(msg["seq"])
        self._buffered_bytes += size - (old[1] if old is not None else 0)
        self._buffer[msg["seq"]] = (msg, size)

    def _unbuffer(self, seq: int) -> dict[str, Any] | None:
        item = self._buffer.pop(seq, None)
        if item is None:
            return None
        self._buffered_bytes -= item[1]
        return item[0]

    def _clear_buffer(self) -> None:
        self._buffer.clear()
        self._buffered_bytes = 0

    def _drain_buffer(self, updates: list[Update]) -> None:
        """Apply buffered batches that continue last_seq; on a gap ask for a replay."""
        if not self._synced:
            return
        while self._buffer:
            nxt = self.last_seq + 1
            batch = self._unbuffer(nxt)
            if batch is None:
                stale = [s for s in self._buffer if s <= self.last_seq]
                for s in stale:
                    self._unbuffer(s)
                if self._buffer and self._pending_req is None:
                    self.gaps += 1
                    if self._publisher_dropped_since(min(self._buffer)):
                        self._request_snapshot()  # those batches were never published
                    else:
                        self._request_replay()
                return
            if batch["epoch"] != self.epoch:
                continue
            if not self._apply(batch, updates):
                return

    def _apply(self, batch: dict[str, Any], updates: list[Update]) -> bool:
        with self.lock:
            try:
                self.state.apply(batch)
            except ProtocolError as e:
                self.apply_errors += 1
                self.refused = f"batch {batch.get('seq')} refused: {e}"
                ok = False
            else:
                ok = True
                self.last_seq = batch["seq"]
                n = len(batch["events"])
                self.batches_applied += 1
                self.events_applied += n
                now = time.monotonic()
                self._rate.append((now, n))
                self._trim_rate(now)
                self._note_drops(batch.get("stats"))
                if self.on_apply is not None:
                    self.on_apply(batch, self.state)
        if not ok:  # our mirror and the publisher disagree: start over
            self._synced = False
            self._request_snapshot()
            return False
        updates.append(batch)
        return True

    def _trim_rate(self, now: float) -> None:
        """Keep ``_rate`` to the window ``events_per_s`` reads (it grew without bound
        when nobody read the rate)."""
        rate = self._rate
        while rate and now - rate[0][0] > 2.0:
            rate.popleft()

    def _publisher_dropped_since(self, seq: int) -> bool:
        """Batch ``seq`` (buffered, after a gap) says the publisher dropped batches since
        the last one applied: the gap holds some, which no replay can fill."""
        dropped = StepStats.read(self._buffer[seq][0].get("stats")).dropped_batches
        return dropped is not None and dropped > self.publisher_dropped

    def _note_drops(self, stats: Any) -> None:
        # every batch: the one field read straight from a map (what StepStats.read gives
        # for it: an int, bool excluded), anything else through StepStats.read
        dropped = stats.get("dropped_batches") if type(stats) is dict else None
        if type(dropped) is not int:
            dropped = StepStats.read(stats).dropped_batches
        if dropped is not None:
            self.publisher_dropped = dropped
        failed = stats.get("recording_error") if type(stats) is dict else None
        if type(failed) is str:
            self.publisher_recording_error = failed[:200]  # shown in a banner: bounded

    # ------------------------------------------------------------ DEALER replies
    def _on_reply(self, frames: list[bytes], updates: list[Update]) -> None:
        try:
            msg = self.codec.decode(frames[-1])
        except ProtocolError:
            return
        self._last_heard = time.monotonic()
        mtype = msg["type"]
        if mtype == C.MSG_BATCH:  # a replayed batch
            if self._synced and msg["epoch"] == self.epoch:
                self._buffer_batch(msg, len(frames[-1]))
            return
        pending = self._pending_req
        if pending is None or msg.get("id") != pending[1]:
            return  # a late answer to a request we gave up on
        self._pending_req = None
        if mtype == C.MSG_SNAPSHOT:
            self._install(msg, updates)
        elif mtype == C.MSG_REPLAY_END:
            if msg["ok"] and msg["epoch"] == self.epoch:
                self.replays += 1
                self._drain_buffer(updates)
            else:
                self._synced = False
                self._request_snapshot()
        else:  # error (e.g. publisher state unavailable): ask again after the timeout
            self._pending_req = (C.MSG_GET_SNAPSHOT, -1, time.monotonic())

    def _install(self, msg: dict[str, Any], updates: list[Update]) -> None:
        try:
            state = KVState.from_snapshot(msg["state"])
        except ProtocolError as e:
            self.codec.errors["snapshot"] += 1
            self.refused = f"snapshot refused: {e}"[:500]
            self._request_snapshot()
            return
        info = msg.get("info")
        update = {"type": C.MSG_SNAPSHOT, "epoch": msg["epoch"], "seq": msg["seq"],
                  "step": state.step, "info": info if isinstance(info, dict) else {}}
        with self.lock:
            if self.epoch is not None:
                self.resyncs += 1
                if self.epoch == msg["epoch"]:
                    self.skipped_batches += max(0, msg["seq"] - self.last_seq)
            self.state, self.epoch, self.last_seq = state, msg["epoch"], msg["seq"]
            self._synced = True
            self._note_drops(state.stats)
            if self.on_apply is not None:
                self.on_apply(update, self.state)
        for s in [s for s, (b, _) in self._buffer.items() if b["epoch"] != self.epoch]:
            self._unbuffer(s)
        updates.append(update)
        self._drain_buffer(updates)

    # ---------------------------------------------------------------- requests
    def _request_snapshot(self) -> None:
        self._send_request(C.MSG_GET_SNAPSHOT)

    def _request_replay(self) -> None:
        self._send_request(C.MSG_REPLAY, **{"from": self.last_seq + 1})

    def _send_request(self, mtype: str, **fields: Any) -> None:
        rid = next(self._ids)
        try:
            self._dealer.send(self.codec.encode(C.make_request(mtype, id=rid, **fields)),
                              zmq.NOBLOCK)
        except zmq.Again:
            pass  # no route yet: the timeout below asks again
        self._pending_req = (mtype, rid, time.monotonic())

    def _check_handshakes(self) -> None:
        """Read the monitors' handshake events (never waits)."""
        from zmq.utils.monitor import recv_monitor_message

        for mon, where in zip(self._monitors, (self.endpoint, self.snapshot_endpoint),
                              strict=True):
            while mon.get(zmq.EVENTS) & zmq.POLLIN:  # usually nothing: no exception raised
                try:
                    ev = recv_monitor_message(mon, zmq.NOBLOCK)
                except zmq.Again:
                    break
                if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._handshake_problem = None
                else:
                    self.handshake_failures += 1
                    self._handshake_problem = self._explain(ev["event"], ev["value"], where)

    def _explain(self, event: int, value: int, where: str) -> str:
        """A failed handshake with ``where``, in words: what to do about it."""
        keys = self.keys is not None
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (f"{where} refused this client's key (status {value}): its "
                    "allowed_clients/ lacks our client.key (add it there and restart the "
                    "publisher)")
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and \
                value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if keys:
                return f"{where} does not use keys: connect without --keys"
            return f"{where} requires keys: {HOW_TO_MAKE}"
        # the peer closed mid-handshake (libzmq gives no detail): a CURVE publisher that
        # could not read our hello, or a plain one that does not speak CURVE
        if keys:
            return (f"the security handshake with {where} failed: the publisher there does "
                    "not hold the secret of our server.key (wrong keys, another server) or "
                    "does not use keys")
        return (f"the handshake with {where} failed: the publisher there likely requires "
                f"keys; {HOW_TO_MAKE}")

    def _check_request_timeout(self) -> None:
        pending = self._pending_req
        if pending is not None and time.monotonic() - pending[2] > self.request_timeout_s:
            self._synced = False  # whatever we asked for never came: start over
            self._request_snapshot()


    def _received(self, sock: zmq.Socket, limit: int) -> Iterator[list[bytes]]:
        """Up to ``limit`` waiting messages, received one at a time as the caller asks,
        each within ``max_bytes`` and ``max_frames`` (one past them is dropped, counted
        and its reason kept in ``refused``)."""
        for _ in range(limit):
            try:
                yield recv_bounded(sock, self.codec.max_bytes, self.max_frames, zmq.NOBLOCK)
            except zmq.Again:
                return
            except MessageTooLarge as e:
                self.codec.errors["size"] += 1
                self.refused = f"{self.endpoint}: {e}"
