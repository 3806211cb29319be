"""The ZeroMQ side of the event stream: a PUB socket for batches and heartbeats, and a
ROUTER socket that answers snapshot and replay requests.

Used only from the EventStream's publisher thread (ZeroMQ sockets belong to one thread;
they are created and bound in the constructor so that bind errors reach the caller, and
handed over when the thread starts).

Snapshot requests wait until the engine hands over a cache snapshot (at its next step
boundary, or at once when it idles; see ``EventStream``); every client waiting then gets
that one snapshot, encoded once. Requests arrive as one msgpack frame from a DEALER:
``{"v", "type": "get_snapshot", "id"}`` or ``{"v", "type": "replay", "from": seq, "id"}``;
every reply echoes ``id``. A replay reply is the buffered batch payloads (byte-identical
to what PUB sent) followed by a ``replay_end`` with ``ok`` False when any requested seq
is no longer buffered.

A client is untrusted (it may flood requests, or never read its replies); the bounds that
keep it from slowing the engine or the other clients:
- requests are read at most ``MAX_REQUESTS_PER_S`` a second (up to
  ``MAX_REQUESTS_PER_ROUND`` at once): the rest wait in the socket, where ZeroMQ queues
  them per client and takes them in turn (a flooder's backlog does not delay another
  client's request behind all of it) and, once full, pushes back on the flooder. So a
  flood costs the stream thread, which shares the GIL with the engine, a bounded time;
- snapshot requests are coalesced: one waiting entry per client, and the EventStream
  asks the engine for at most one snapshot per ``snapshot_interval_s``;
- replays draw on a budget (``replay_size`` batches a second, up to ``replay_size`` at
  once); a request beyond it gets ``replay_end`` with ``ok`` False, and the subscriber
  falls back to a (coalesced) snapshot;
- replies are sent without blocking (ROUTER_MANDATORY): a client whose queue is full
  (``SNDHWM`` messages: it stopped reading) loses the reply (``replies_dropped``) and
  the rest of that replay; nothing else waits on it.

Keys (``engine.events.wire.keys``): with ``keys`` both sockets are CURVE servers and a
ZAP handler (its own thread, on this publisher's context) admits only the clients whose
public keys are allowed; others fail the handshake and never reach a socket, so they
cost the stream thread nothing. Without keys a non-local endpoint is refused before
anything binds (``check_bind``).
"""

from __future__ import annotations

import collections
import logging
import re
import time
from typing import Any

import msgpack
import zmq

from kvscope.engine.events.schema import ProtocolError
from kvscope.engine.events.wire import codec as C
from kvscope.engine.events.wire.keys import ServerKeys, check_bind, server_keys

log = logging.getLogger(__name__)

MAX_SNAPSHOT_WAITERS = 1024  # clients waiting for the next snapshot at once
# requests handled per round before the stream thread goes back to the engine's batches
MAX_REQUESTS_PER_ROUND = 256
# a subscriber asks once when it joins and once per gap: 500/s serves hundreds of them
MAX_REQUESTS_PER_S = 500
_TCP = re.compile(r"^tcp://(?P<host>[^:]+|\[[^\]]+\]):(?P<port>\d+|\*)$")


def snapshot_endpoint_for(endpoint: str) -> str:
    """The default snapshot/replay endpoint: the PUB port + 1 (ephemeral stays ephemeral)."""
    m = _TCP.match(endpoint)
    if m is None:
        raise ValueError(f"cannot derive a snapshot endpoint from {endpoint!r}; pass one")
    port = m["port"]
    if port in ("*", "0"):
        return f"tcp://{m['host']}:*"
    return f"tcp://{m['host']}:{int(port) + 1}"


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    endpoint = re.sub(r":0$", ":*", endpoint)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise OSError(f"cannot bind event endpoint {endpoint}: {e}") from e
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class Publisher:
    """PUB + ROUTER sockets, the replay ring, heartbeats. One thread only."""

    def __init__(self, endpoint: str, snapshot_endpoint: str | None, epoch: str, *,
                 replay_size: int = 4096, heartbeat_s: float = 1.0, sndhwm: int = 10000,
                 info: dict[str, Any] | None = None,
                 keys: ServerKeys | str | None = None) -> None:
        keys = server_keys(keys)  # KeysError (a ValueError) before any socket exists
        check_bind(endpoint, keys)
        snapshot_endpoint_given = snapshot_endpoint
        snapshot_endpoint = snapshot_endpoint or snapshot_endpoint_for(endpoint)
        check_bind(snapshot_endpoint, keys, "the snapshot/replay socket")
        self.keys = keys
        self.epoch = epoch
        self.info = info or {}  # sent with every snapshot (engine config, model)
        self.heartbeat_s = heartbeat_s
        self.codec = C.Codec(max_bytes=1 << 20)  # requests are tiny
        self.ring: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=replay_size)
        self.last_seq = 0
        self.snapshots_served = 0
        self.replays_served = 0
        self.request_errors = 0
        self.replays_refused = 0  # over the replay budget
        self.replies_dropped = 0  # the client's queue was full (or it was gone)
        # replay budget in batches: refills at replay_size a second, holds replay_size
        self.requests_received = 0
        self._clock = time.monotonic  # the replay budget's clock (tests freeze it)
        self._replay_rate = float(replay_size)
        self._replay_tokens = float(replay_size)
        self._replay_refilled = self._clock()
        self.max_requests_per_s = float(MAX_REQUESTS_PER_S)
        self._request_tokens = float(MAX_REQUESTS_PER_ROUND)
        self._requests_refilled = self._replay_refilled
        self.snapshot_waiters: dict[bytes, Any] = {}  # client identity -> request id
        self._ctx = zmq.Context()
        self._auth: Any = None
        self._pub = self._ctx.socket(zmq.PUB)
        self._router = self._ctx.socket(zmq.ROUTER)
        for s in (self._pub, self._router):
            s.setsockopt(zmq.LINGER, 200)
        if keys is not None:
            from zmq.auth.thread import ThreadAuthenticator

            self._auth = ThreadAuthenticator(self._ctx, log=log)
            self._auth.start()  # before binding: no handshake may pass unchecked
            self._auth.configure_curve(domain="*", location=str(keys.allowed_dir))
            for s in (self._pub, self._router):
                s.curve_secretkey = keys.secret
                s.curve_publickey = keys.public
                s.curve_server = True
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue fails, never waits
        self._pub.setsockopt(zmq.SNDHWM, sndhwm)
        self._router.setsockopt(zmq.SNDHWM, replay_size + 16)
        try:
            self.endpoint = _bind(self._pub, endpoint)
            try:
                self.snapshot_endpoint = _bind(self._router, snapshot_endpoint)
            except OSError as e:
                if snapshot_endpoint_given:
                    raise
                # the derived port is the one a user did not choose: say where it came from
                raise OSError(f"{e} (the snapshot/replay endpoint is the event port + 1; "
                              "leave a free port after each event port)") from e
        except BaseException:
            self.close()
            raise
        self._last_send = time.monotonic()

    def publish(self, seq: int, payload: bytes) -> None:
        """Send one encoded batch (never blocks: PUB drops for a subscriber at its HWM)."""
        self._pub.send_multipart([C.TOPIC, C.encode_seq(seq), payload], copy=False)
        self.ring.append((seq, payload))
        self.last_seq = seq
        self._last_send = time.monotonic()

    def heartbeat_if_idle(self) -> None:
        now = time.monotonic()
        if now - self._last_send >= self.heartbeat_s:
            msg = C.make_heartbeat(self.epoch, self.last_seq, time.time())
            self._pub.send_multipart(self.codec.encode_frames(msg))
            self._last_send = now

    def serve_requests(self, can_snapshot: bool = True) -> int:
        """Answer every waiting replay request; queue snapshot requests (answered by
        ``answer_snapshots`` once the engine has taken one) or refuse them at once when
        ``can_snapshot`` is False. Reads what the request budget allows (module
        docstring; the rest wait in the socket). Returns how many snapshot requests
        wait."""
        now = self._clock()
        elapsed = max(0.0, now - self._requests_refilled)
        self._request_tokens = min(float(MAX_REQUESTS_PER_ROUND),
                                   self._request_tokens + elapsed * self.max_requests_per_s)
        self._requests_refilled = now
        while self._request_tokens >= 1:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.requests_received += 1
            self._request_tokens -= 1
            ident, body = frames[0], frames[-1]
            try:
                if len(frames) < 2:
                    raise ProtocolError("empty request")
                req = self.codec.decode(body)
            except ProtocolError as e:
                self.request_errors += 1
                self._reply(ident, C.make_request(C.MSG_ERROR, reason=f"bad request: {e}"))
                continue
            rid = req.get("id")
            if req["type"] == C.MSG_GET_SNAPSHOT:
                if not can_snapshot:
                    self._reply(ident, C.make_request(
                        C.MSG_ERROR, id=rid, reason="this publisher has no snapshot source"))
                elif ident in self.snapshot_waiters or \
                        len(self.snapshot_waiters) < MAX_SNAPSHOT_WAITERS:
                    self.snapshot_waiters[ident] = rid  # a client's newest request wins
                else:
                    self.request_errors += 1
                    self._reply(ident, C.make_request(
                        C.MSG_ERROR, id=rid, reason="too many snapshot requests waiting"))
            elif req["type"] == C.MSG_REPLAY:
                self._replay(ident, int(req["from"]), rid)
            else:
                self.request_errors += 1
                self._reply(ident, C.make_request(
                    C.MSG_ERROR, id=rid, reason=f"cannot serve a {req['type']!r} request"))
        return len(self.snapshot_waiters)

    def answer_snapshots(self, seq: int, state: dict[str, Any]) -> None:
        """Send ``state`` (``KVState.snapshot()`` form, the state after batch ``seq``,
        which was published before this call) to every waiting snapshot request."""
        if not self.snapshot_waiters:
            return
        body = self.codec.encode({**C.make_snapshot(self.epoch, seq, state),
                                  "info": self.info})
        for ident, rid in self.snapshot_waiters.items():
            if self._send(ident, _with_id(body, rid)):
                self.snapshots_served += 1
        self.snapshot_waiters = {}

    def _replay(self, ident: bytes, start: int, rid: Any) -> None:
        wanted = [(s, p) for s, p in self.ring if s >= start]
        expected = max(0, self.last_seq - start + 1)
        ok = len(wanted) == expected  # a hole (lost batch) or aged out: cannot replay
        end: dict[str, Any] = {"epoch": self.epoch, "ok": ok, "from": start,
                               "to": self.last_seq, "id": rid}
        if not ok:
            oldest = self.ring[0][0] if self.ring else None
            end["reason"] = f"seq {start}..{self.last_seq} not all buffered (oldest {oldest})"
        elif not self._spend_replay_budget(len(wanted)):
            self.replays_refused += 1
            end["ok"] = False
            end["reason"] = "replay budget spent (too many replays asked); take a snapshot"
        else:
            for _, payload in wanted:
                if not self._send(ident, payload):
                    return  # the client stopped reading: the rest would be dropped too
            self.replays_served += 1
        self._reply(ident, C.make_request(C.MSG_REPLAY_END, **end))

    def _spend_replay_budget(self, batches: int) -> bool:
        now = self._clock()
        self._replay_tokens = min(
            self._replay_rate,
            self._replay_tokens + max(0.0, now - self._replay_refilled) * self._replay_rate)
        self._replay_refilled = now
        if batches > self._replay_tokens:
            return False
        self._replay_tokens -= batches
        return True

    def _send(self, ident: bytes, body: bytes) -> bool:
        """One reply, never blocking: False (counted) when the client's queue is full or
        the client is gone."""
        try:
            self._router.send_multipart([ident, body], zmq.NOBLOCK, copy=False)
        except (zmq.Again, zmq.error.ZMQError):  # full queue; EHOSTUNREACH: gone
            self.replies_dropped += 1
            return False
        return True

    def _reply(self, ident: bytes, msg: dict[str, Any]) -> None:
        self._send(ident, self.codec.encode(msg))

    def close(self) -> None:
        for s in (self._pub, self._router):
            s.close()
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self._ctx.term()


def _with_id(body: bytes, rid: Any) -> bytes:
    """``body`` (a msgpack map of fewer than 15 keys, without "id") with ``"id": rid``
    appended: one snapshot encoding serves every waiting request."""
    n = body[0] - 0x80
    if not 0 <= n < 15:
        raise ValueError("expected a msgpack fixmap of fewer than 15 keys")
    return bytes((0x81 + n,)) + body[1:] + msgpack.packb("id") + msgpack.packb(rid)
