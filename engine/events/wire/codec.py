"""Wire codec: msgpack messages, ZeroMQ frames and envelope validation.

Every message is a self-describing msgpack map with ``"v"`` (PROTOCOL_VERSION) and
``"type"``. The types (``MSG_*`` below):

    batch      one engine step, published on PUB and replayed over ROUTER:
               {v, type, epoch, seq, step, time, events: [event...], stats: {...}}
    heartbeat  sent on PUB when idle (~1 s): {v, type, epoch, seq (last batch), time}
    snapshot   reply to a snapshot request: {v, type, epoch, seq, step, state, info?}
               where ``state`` is ``KVState.snapshot()`` after the batch ``seq`` and
               ``info`` the publisher's header (model, engine config)
    replay_end closes a replay reply: {v, type, epoch, ok, from, to, reason?}
    error      reply to a request the publisher cannot serve: {v, type, reason}
Requests (DEALER -> ROUTER): {v, type: "get_snapshot", id} and {v, type: "replay", from, id};
every reply echoes the request's ``id``.

PUB frames are ``[TOPIC, seq as 8-byte big-endian, payload]``; a heartbeat carries the
seq of the last batch (batch seqs are strictly increasing, heartbeats repeat them).

Decoding never trusts its input: the message size is capped (``max_bytes``; msgpack
then caps every declared str/bin/array/map length at the message size, so a "4 GiB
array" header in a 20-byte frame fails at once), map keys must be strings, and the
envelope is checked field by field. Everything wrong raises ``ProtocolError`` with a
message that says what was wrong; ``Codec.errors`` counts them by reason.
"""

from __future__ import annotations

import struct
from collections import Counter
from typing import Any

import msgpack

from engine.events.schema import (
    BLOCK_ID_FIELDS,
    PROTOCOL_VERSION,
    READABLE_VERSIONS,
    ProtocolError,
)
from engine.events.state import pack_ids

TOPIC = b"kv"

MSG_BATCH = "batch"
MSG_HEARTBEAT = "heartbeat"
MSG_SNAPSHOT = "snapshot"
MSG_GET_SNAPSHOT = "get_snapshot"  # request
MSG_REPLAY = "replay"  # request
MSG_REPLAY_END = "replay_end"
MSG_ERROR = "error"
MSG_TYPES = (MSG_BATCH, MSG_HEARTBEAT, MSG_SNAPSHOT, MSG_GET_SNAPSHOT, MSG_REPLAY,
             MSG_REPLAY_END, MSG_ERROR)

# A snapshot of a 1M-block cache is ~10 MiB of msgpack; 256 MiB leaves room and still
# stops a hostile peer from making us allocate gigabytes.
DEFAULT_MAX_BYTES = 256 << 20

_SEQ = struct.Struct(">Q")

# Field -> accepted types, per message type (checked by ``validate``).
_INT = (int,)
_NUM = (int, float)
_REQUIRED: dict[str, dict[str, tuple[type, ...]]] = {
    MSG_BATCH: {"epoch": (str,), "seq": _INT, "step": _INT, "time": _NUM, "events": (list,)},
    MSG_HEARTBEAT: {"epoch": (str,), "seq": _INT, "time": _NUM},
    MSG_SNAPSHOT: {"epoch": (str,), "seq": _INT, "step": _INT, "state": (dict,)},
    MSG_GET_SNAPSHOT: {},
    MSG_REPLAY: {"from": _INT},
    MSG_REPLAY_END: {"epoch": (str,), "ok": (bool,)},
    MSG_ERROR: {"reason": (str,)},
}


def encode_seq(seq: int) -> bytes:
    return _SEQ.pack(seq)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise ProtocolError(f"seq frame has {len(frame)} bytes, expected 8")
    return _SEQ.unpack(frame)[0]


def validate(msg: Any) -> dict[str, Any]:
    """Check a decoded message's envelope; return it. Unknown extra fields are allowed."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"message is a {type(msg).__name__}, expected a map")
    v = msg.get("v")
    if v not in READABLE_VERSIONS or isinstance(v, bool):
        raise ProtocolError(f"protocol version {v!r}, this reader speaks "
                            f"{'/'.join(map(str, READABLE_VERSIONS))}")
    mtype = msg.get("type")
    fields = _REQUIRED.get(mtype)  # type: ignore[arg-type]
    if fields is None:
        raise ProtocolError(f"unknown message type {mtype!r}")
    for name, types in fields.items():
        value = msg.get(name)
        # bool is an int subclass: accept it only where a bool is asked for.
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ProtocolError(
                f"{mtype} field {name!r} is {type(value).__name__}, "
                f"expected {'/'.join(t.__name__ for t in types)}"
            )
    if "seq" in fields and msg["seq"] < 0:
        raise ProtocolError(f"{mtype} seq {msg['seq']} is negative")
    if mtype == MSG_BATCH:
        for ev in msg["events"]:
            if not isinstance(ev, dict) or not isinstance(ev.get("kind"), str):
                raise ProtocolError("batch event is not a map with a string 'kind'")
        if not isinstance(msg.get("stats", {}), dict):
            raise ProtocolError("batch 'stats' is not a map")
    return msg


class Codec:
    """One reusable msgpack Packer plus bounded, validating decoding.

    Not thread-safe (the Packer keeps a buffer): give each thread its own Codec.
    ``errors`` counts decode failures by a short reason ("msgpack", "envelope", ...).
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._packer = msgpack.Packer(use_bin_type=True)
        self.errors: Counter[str] = Counter()

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())

    def encode(self, msg: dict[str, Any]) -> bytes:
        return self._packer.pack(msg)

    def decode(self, data: bytes) -> dict[str, Any]:
        """Bytes -> validated message. Raises ProtocolError (and counts it)."""
        if len(data) > self.max_bytes:
            raise self._fail("size", f"message of {len(data)} bytes exceeds limit {self.max_bytes}")
        try:
            # unpackb caps every declared length at len(data) (see module docstring).
            msg = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
        except Exception as e:  # msgpack raises ValueError, ExtraData, FormatError, ...
            raise self._fail("msgpack", f"undecodable msgpack ({type(e).__name__}: {e})") from None
        try:
            return validate(msg)
        except ProtocolError as e:
            raise self._fail("envelope", str(e)) from None

    def decode_frames(self, frames: list[bytes]) -> tuple[int, dict[str, Any]]:
        """PUB frames [topic, seq, payload] -> (seq, message); checks they agree."""
        if len(frames) != 3:
            raise self._fail("frames", f"expected 3 frames [topic, seq, payload], "
                                       f"got {len(frames)}")
        topic, seq_frame, payload = frames
        if topic != TOPIC:
            raise self._fail("frames", f"unexpected topic {bytes(topic[:32])!r}")
        try:
            seq = decode_seq(seq_frame)
        except ProtocolError as e:
            raise self._fail("frames", str(e)) from None
        msg = self.decode(payload)
        if msg["type"] not in (MSG_BATCH, MSG_HEARTBEAT):
            raise self._fail("frames", f"{msg['type']} message on the PUB stream")
        if msg["seq"] != seq:
            raise self._fail("frames", f"seq frame {seq} disagrees with payload seq {msg['seq']}")
        return seq, msg

    def encode_frames(self, msg: dict[str, Any]) -> list[bytes]:
        return [TOPIC, encode_seq(msg["seq"]), self.encode(msg)]

    def _fail(self, reason: str, text: str) -> ProtocolError:
        self.errors[reason] += 1
        return ProtocolError(text)


def pack_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Protocol 2 wire form, in place: each ``BLOCK_ID_FIELDS`` list becomes packed
    little-endian int32 bytes (5 bytes per id as msgpack ints -> 4, and one memcpy to
    decode instead of one object per id). Returns ``events``."""
    for ev in events:
        for name in BLOCK_ID_FIELDS:
            ids = ev.get(name)
            if type(ids) is list:
                ev[name] = pack_ids(ids)
    return events


def make_batch(epoch: str, seq: int, step: int, time: float, events: list[dict[str, Any]],
               stats: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": MSG_BATCH, "epoch": epoch, "seq": seq,
            "step": step, "time": time, "events": events, "stats": stats or {}}


def make_heartbeat(epoch: str, seq: int, time: float) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": MSG_HEARTBEAT, "epoch": epoch, "seq": seq,
            "time": time}


def make_snapshot(epoch: str, seq: int, state: dict[str, Any]) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": MSG_SNAPSHOT, "epoch": epoch, "seq": seq,
            "step": state.get("step", -1), "state": state}


def make_request(mtype: str, **fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": mtype, **fields}
