"""VllmSubscriber: reads a vLLM-format KV-event stream (vLLM, SGLang, kvscope ...).

    sub = VllmSubscriber("tcp://127.0.0.1:5557")                  # publisher binds
    sub = VllmSubscriber("tcp://127.0.0.1:5557", bind=True)       # publisher connects
    for batch in sub.batches(timeout_s=1.0):   # VllmBatch, in seq order; stops on timeout
        ...
    sub.close()

Connect or bind: vLLM's publisher BINDS a wildcard (``tcp://*:N``) or ipc endpoint and
CONNECTS to a concrete ``tcp://host:N``. So, against ``endpoint="tcp://*:N"`` vLLM, connect
to ``tcp://127.0.0.1:N`` (the default here); against ``endpoint="tcp://127.0.0.1:N"``
vLLM, bind that address (``bind=True``). A wildcard address given here is always bound.

Gaps: with ``replay_endpoint`` a seq gap is filled from the publisher's ROUTER (DEALER
request, replies until seq -1); batches already seen are skipped. A seq that goes
BACKWARDS means a new publisher (vLLM restarts seq at 0): that batch comes with
``restarted`` True and the reader should drop what it holds. Undecodable messages are
counted in ``errors`` (``last_error`` says why) and skipped; the subscriber goes on.

Bounded (docs/events.md, "Limits"): each frame within ``max_bytes`` (``ZMQ_MAXMSGSIZE``:
libzmq drops the peer past it) and each message within ``max_bytes`` over all its frames
and ``max_frames`` frames (``receive.recv_bounded``: one past them is dropped as read,
counted in ``errors`` and named in ``last_error``). What the reader builds from the
batches (a ``KVState`` through the translator) has that state's own limits.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from kvscope.engine.events.schema import ProtocolError
from kvscope.engine.events.vllm import kv_events_wire as W
from kvscope.engine.events.wire.codec import DEFAULT_MAX_BYTES
from kvscope.engine.events.wire.receive import DEFAULT_MAX_FRAMES, recv_bounded


@dataclass
class VllmBatch:
    seq: int
    ts: float
    events: list[dict[str, Any]]
    data_parallel_rank: int | None = None
    topic: bytes = b""
    recv_time: float = field(default_factory=time.time)
    replayed: bool = False
    restarted: bool = False


def decode_frames(topic: bytes, seq_bytes: bytes, payload: bytes,
                  recv_time: float | None = None) -> VllmBatch:
    """One PUB message to a VllmBatch. Raises VllmWireError."""
    seq = W.decode_seq(seq_bytes)
    b = W.decode(payload)
    return VllmBatch(seq, b["ts"], b["events"], b["data_parallel_rank"], topic,
                     recv_time if recv_time is not None else time.time())


class VllmSubscriber:
    def __init__(self, endpoint: str, *, bind: bool = False, replay_endpoint: str | None = None,
                 topic: str = "", replay_timeout_s: float = 2.0,
                 recorder: Any = None, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_frames: int = DEFAULT_MAX_FRAMES) -> None:
        """``recorder``: optional ``VllmRecordingWriter``; every decodable message is
        written to it as received (raw bytes), before ordering and replay.
        ``max_bytes``/``max_frames``: the most one message may hold (module docstring)."""
        self.endpoint = endpoint
        self.max_bytes, self.max_frames = max_bytes, max_frames
        self.replay_endpoint = replay_endpoint
        self.replay_timeout_s = replay_timeout_s
        self.recorder = recorder
        self.last_seq: int | None = None
        self.errors = 0
        self.last_error = ""
        self.gaps = 0  # seq gaps seen (filled by replay or not)
        self.missed = 0  # batches lost for good (gap not replayable)
        self.restarts = 0
        self.received = 0
        self._ctx = zmq.Context.instance()
        self.bound = bind or "*" in endpoint
        self._topic = topic.encode("utf-8")
        self._monitor: zmq.Socket | None = None
        # Bound, a SUB socket's subscription never reached a PUB that connected later
        # (libzmq 4.3.5 here, tcp and ipc alike), so the bound side is an XSUB that sends
        # the subscription itself each time a publisher's handshake completes.
        self._sub = self._ctx.socket(zmq.XSUB if self.bound else zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.MAXMSGSIZE, max_bytes)  # a hostile frame dies in libzmq
        try:
            if self.bound:
                self._monitor = self._sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
                self._sub.bind(endpoint.replace("tcp://127.0.0.1:0", "tcp://127.0.0.1:*"))
                self.endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
                self._sub.connect(endpoint)
        except zmq.ZMQError as e:
            self.close()
            verb = "bind" if self.bound else "connect to"
            raise OSError(f"cannot {verb} vLLM event endpoint {endpoint}: {e}") from e
        self._poller = zmq.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        if self._monitor is not None:
            self._poller.register(self._monitor, zmq.POLLIN)
        self._pending: list[VllmBatch] = []

    # ------------------------------------------------------------------ reading
    def recv(self, timeout_s: float = 1.0) -> VllmBatch | None:
        """The next batch in seq order, or None after ``timeout_s`` without one."""
        if self._pending:
            return self._pending.pop(0)
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            ready = dict(self._poller.poll(int(left * 1000) + 1)) if left > 0 else {}
            if not ready:
                return None
            if self._monitor is not None and self._monitor in ready:
                self._monitor.recv_multipart()  # a publisher connected: subscribe it
                self._sub.send(b"\x01" + self._topic)
            if self._sub not in ready:
                continue
            try:
                frames = recv_bounded(self._sub, self.max_bytes, self.max_frames)
            except ProtocolError as e:  # MessageTooLarge: dropped as it was read
                self._error(str(e))
                continue
            if len(frames) != 3:
                self._error(f"message of {len(frames)} frames, expected 3")
                continue
            try:
                batch = decode_frames(*frames)
            except W.VllmWireError as e:
                self._error(str(e))
                continue
            if self.recorder is not None:
                self.recorder.write(*frames, recv_time=batch.recv_time)
            out = self._order(batch)
            if out:
                self._pending.extend(out[1:])
                return out[0]

    def batches(self, timeout_s: float = 1.0) -> Iterator[VllmBatch]:
        """Yield batches until ``timeout_s`` passes without one."""
        while (b := self.recv(timeout_s)) is not None:
            yield b

    def close(self) -> None:
        if self._monitor is not None:
            self._sub.disable_monitor()
            self._monitor.close(linger=0)
        self._sub.close(linger=0)

    def __enter__(self) -> VllmSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals
    def _error(self, msg: str) -> None:
        self.errors += 1
        self.last_error = msg

    def _order(self, batch: VllmBatch) -> list[VllmBatch]:
        last = self.last_seq
        self.received += 1
        if last is not None and batch.seq <= last:
            if batch.seq == last:  # a duplicate (e.g. replay overlap)
                return []
            self.restarts += 1
            batch.restarted = True
        elif last is not None and batch.seq > last + 1:
            self.gaps += 1
            filled = self._replay(last + 1, batch.seq)
            self.missed += batch.seq - last - 1 - len(filled)
            self.last_seq = batch.seq
            return [*filled, batch]
        self.last_seq = batch.seq
        return [batch]

    def _replay(self, start: int, stop: int) -> list[VllmBatch]:
        """Batches ``start <= seq < stop`` from the replay ROUTER ([] without one)."""
        if self.replay_endpoint is None:
            return []
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, self.max_bytes)
        out: list[VllmBatch] = []
        try:
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart((b"", W.encode_seq(start)))
            end = time.monotonic() + self.replay_timeout_s
            while dealer.poll(max(1, int((end - time.monotonic()) * 1000))):
                try:
                    frames = recv_bounded(dealer, self.max_bytes, self.max_frames)
                except ProtocolError as e:
                    self._error(f"replay: {e}")
                    continue
                if len(frames) != 4:
                    self._error(f"replay reply of {len(frames)} frames, expected 4")
                    continue
                _, topic, seq_bytes, payload = frames
                try:
                    seq = W.decode_seq(seq_bytes)
                    if seq == W.END_SEQ:
                        break
                    if start <= seq < stop:
                        b = decode_frames(topic, seq_bytes, payload)
                        b.replayed = True
                        out.append(b)
                except W.VllmWireError as e:
                    self._error(f"replay: {e}")
        finally:
            dealer.close(linger=0)
        return out
