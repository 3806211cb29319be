"""Wire codec: msgpack messages, ZeroMQ frames and envelope validation.

Every message is a self-describing msgpack map with ``"v"`` (PROTOCOL_VERSION) and
``"type"``. The types (``MSG_*``; their fields are the message classes below):

    batch      one engine step, published on PUB and replayed over ROUTER:
               {v, type, epoch, seq, step, time, events: [event...], stats: {...},
                cols?: {...}}  (protocol 3, bulk steps: the hot events as packed
               columns, ``engine.events.columns``; ``events`` then holds the others.
               Decoded, ``events`` is the whole step again and ``columns`` the columns)
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

Decoding never trusts its input: the message size is capped (``max_bytes``; both
decoders, msgspec on the typed path and msgpack on the checked one, refuse a declared
str/bin/array/map length the bytes left cannot hold, so a "4 GiB array" header in a
20-byte frame fails at once), map keys must be strings (the typed path checks the maps
it types: envelope, events, causes and the top level of stats), the envelope is checked
field by field and every event of a known kind against its type
(``engine.events.schema``). Everything wrong raises ``ProtocolError`` with a message
that says what was wrong; ``Codec.errors`` counts them by reason.
"""

from __future__ import annotations

import struct
from collections import Counter
from typing import Annotated, Any, Literal

import msgpack
import msgspec
from msgspec import UNSET

from kvscope.engine.events import schema as S
from kvscope.engine.events.columns import StepColumns
from kvscope.engine.events.schema import (
    BLOCK_ID_FIELDS,
    PROTOCOL_VERSION,
    READABLE_VERSIONS,
    ProtocolError,
)
from kvscope.engine.events.state import pack_ids
from kvscope.engine.events.state_columns import worth_arrays

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

# A snapshot of a 1M-block cache is ~10 MiB of msgpack (a mirror holds at most 4M blocks
# a tier, state.MAX_TIER_BLOCKS); 64 MiB leaves room and keeps what one hostile message
# can make a reader allocate (msgpack to Python objects) in the hundreds of MiB.
DEFAULT_MAX_BYTES = 64 << 20

_SEQ = struct.Struct(">Q")


# ------------------------------------------------------------------ message types
class _Message(msgspec.Struct, tag_field="type", kw_only=True, forbid_unknown_fields=True,
               omit_defaults=True, gc=False):
    """A message's envelope; subclasses are the message types, tagged with their name.
    Unknown envelope fields are allowed on the wire (the decoder keeps them, see
    ``Codec.decode``); ``forbid_unknown_fields`` only sends such a message down the
    checked path."""

    v: Literal[READABLE_VERSIONS]  # type: ignore[valid-type]


Seq = Annotated[int, msgspec.Meta(ge=0)]


class Batch(_Message, tag=MSG_BATCH):
    """One engine step's events (engine.events.schema) and statistics."""

    epoch: str
    seq: Seq
    step: int
    time: float
    events: list[S.AnyEvent]
    stats: S.Opt[dict[str, Any]] = UNSET  # engine.events.stats.StepStats
    # protocol 3: the step's hot events as columns (events then holds the others)
    cols: S.Opt[dict[str, Any]] = UNSET


class Heartbeat(_Message, tag=MSG_HEARTBEAT):
    epoch: str
    seq: Seq  # of the last batch
    time: float


class Snapshot(_Message, tag=MSG_SNAPSHOT):
    epoch: str
    seq: Seq  # the batch the state is after
    step: int
    state: dict[str, Any]  # KVState.snapshot()
    info: S.Opt[Any] = UNSET  # the publisher's header
    id: S.Opt[Any] = UNSET  # the request's


class GetSnapshot(_Message, tag=MSG_GET_SNAPSHOT):
    id: S.Opt[Any] = UNSET


class Replay(_Message, tag=MSG_REPLAY):
    start: int = msgspec.field(name="from")
    id: S.Opt[Any] = UNSET


class ReplayEnd(_Message, tag=MSG_REPLAY_END):
    epoch: str
    ok: bool
    start: S.Opt[Any] = msgspec.field(default=UNSET, name="from")
    to: S.Opt[Any] = UNSET
    reason: S.Opt[Any] = UNSET
    id: S.Opt[Any] = UNSET


class Error(_Message, tag=MSG_ERROR):
    reason: str
    id: S.Opt[Any] = UNSET


MESSAGE_TYPES: dict[str, type[_Message]] = {
    cls.__struct_config__.tag: cls
    for cls in (Batch, Heartbeat, Snapshot, GetSnapshot, Replay, ReplayEnd, Error)}


def _accepted(t: Any) -> tuple[type, ...]:
    """The Python types a decoded msgpack value of field type ``t`` (msgspec.inspect) may
    have (bool is checked apart: it is an int subclass)."""
    mi = msgspec.inspect
    if isinstance(t, mi.UnionType):
        return tuple(x for u in t.types for x in _accepted(u))
    return {mi.IntType: (int,), mi.FloatType: (int, float), mi.StrType: (str,),
            mi.BoolType: (bool,), mi.ListType: (list,), mi.DictType: (dict,)
            }.get(type(t), (object,))


# Required field -> accepted types, per message type (checked by ``check_envelope``).
_REQUIRED: dict[str, dict[str, tuple[type, ...]]] = {
    mtype: {f.encode_name: _accepted(f.type)
            for f in msgspec.inspect.type_info(cls).fields if f.required and f.name != "v"}
    for mtype, cls in MESSAGE_TYPES.items()
}


def encode_seq(seq: int) -> bytes:
    return _SEQ.pack(seq)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise ProtocolError(f"seq frame has {len(frame)} bytes, expected 8")
    return _SEQ.unpack(frame)[0]


def check_envelope(msg: Any) -> dict[str, Any]:
    """Check a decoded message's envelope (its type's required fields, and that a batch's
    events are maps with a string "kind"); return it. Unknown extra fields are allowed."""
    if not isinstance(msg, dict):
        raise ProtocolError(f"message is a {type(msg).__name__}, expected a map")
    v = msg.get("v")
    if v not in READABLE_VERSIONS or isinstance(v, bool):
        raise ProtocolError(f"protocol version {v!r}, this reader speaks "
                            f"{'/'.join(map(str, READABLE_VERSIONS))}")
    mtype = msg.get("type")
    fields = _REQUIRED.get(mtype) if isinstance(mtype, str) else None
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


def typed_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each event of a known kind checked against its type (``engine.events.schema``) and
    given as that type's map: its declared fields as sent, fields it does not declare
    dropped. Events of unknown kinds are passed on as sent (readers count and skip
    them). A field of the wrong type, or a missing required one, raises ProtocolError
    naming the kind and the field."""
    out = []
    types = S.EVENT_TYPES
    for i, ev in enumerate(events):
        cls = types.get(ev["kind"])
        if cls is None:
            out.append(ev)
            continue
        try:
            typed = msgspec.convert(ev, cls)
        except msgspec.ValidationError as e:  # "Expected `int`, got `str` - at `$.seq`"
            raise ProtocolError(f"batch event {i} ({ev['kind']}): {e}") from None
        out.append(msgspec.to_builtins(typed, builtin_types=(bytes,)))
    return out


def validate(msg: Any) -> dict[str, Any]:
    """A decoded message, checked: its envelope, then (a batch) every event against its
    kind's type. Returns the message, a batch's events as ``typed_events`` gives them."""
    check_envelope(msg)
    if msg["type"] == MSG_BATCH:
        msg["events"] = typed_events(msg["events"])
        unpack_columns(msg)
    return msg


def unpack_columns(msg: dict[str, Any]) -> dict[str, Any]:
    """A decoded batch's ``cols`` (protocol 3), checked, in place: ``events`` becomes the
    whole step in order (hot events rebuilt from the columns, id lists packed as in
    protocol 2: every reader of events reads it as before) and ``columns`` the
    ``StepColumns`` (``KVState.apply`` takes the array path on it). Raises
    ProtocolError."""
    raw = msg.pop("cols", None)
    if raw is None:
        return msg
    if msg["v"] < 3:
        raise ProtocolError(f"batch 'cols' in a protocol {msg['v']} message")
    cols = StepColumns.from_wire(raw, msg["events"])
    cols.source = msg["events"] = cols.to_events(packed=True)
    msg["columns"] = cols
    return msg


def wire_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """A batch as it goes on the wire: a bulk step (``state_columns.worth_arrays``: the
    mirror applies it with arrays) as columns plus the other events, any other step as
    events as they are (the writer packs their id lists first: ``pack_events``). A batch
    already holding ``columns`` (a decoded protocol-3 batch) keeps them."""
    cols = batch.get("columns")
    if cols is None:
        events = batch["events"]
        if not worth_arrays(len(events), _num_ids(events)):
            return batch
        cols = StepColumns.from_events(events)
    out = {k: v for k, v in batch.items() if k != "columns"}
    out["events"] = cols.others
    out["cols"] = cols.to_wire()
    return out


def _num_ids(events: list[Any]) -> int:
    """The block ids of ``events`` (any values: a writer may be handed anything)."""
    n = 0
    for ev in events:
        ids = ev.get("blocks") if type(ev) is dict else None
        if type(ids) is list:
            n += len(ids)
        elif type(ids) is bytes:
            n += len(ids) // 4
    return n


class Codec:
    """One reusable msgpack Packer plus bounded, validating decoding.

    Not thread-safe (the Packer keeps a buffer): give each thread its own Codec.
    ``errors`` counts decode failures by a short reason ("msgpack", "envelope", ...).
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._packer = msgpack.Packer(use_bin_type=True)
        self._batch_decoder = msgspec.msgpack.Decoder(Batch)
        self.errors: Counter[str] = Counter()

    @property
    def num_errors(self) -> int:
        return sum(self.errors.values())

    def encode(self, msg: dict[str, Any], columns: bool = True) -> bytes:
        """A message -> bytes (a batch in its wire form: ``wire_batch``; with
        ``columns=False`` as events only, the per-event form benchmarks compare with)."""
        if msg.get("type") == MSG_BATCH:
            msg = wire_batch(msg) if columns else {
                k: v for k, v in msg.items() if k != "columns"}
        return self._packer.pack(msg)

    def decode(self, data: bytes) -> dict[str, Any]:
        """Bytes -> validated message (``validate``). Raises ProtocolError (and counts it).

        Two paths, one result: a batch of known kinds whose envelope holds only its
        declared fields decodes straight into its types (``Batch``: msgspec checks every
        field as it reads it); anything else (another message type, an unknown kind or
        envelope field, or an error) is decoded to plain maps and checked field by field
        (``validate``), which also writes the error. tests/events/test_codec.py checks
        that both give the same maps."""
        if len(data) > self.max_bytes:
            raise self._fail("size", f"message of {len(data)} bytes exceeds limit {self.max_bytes}")
        try:
            batch = self._batch_decoder.decode(data)
        except (msgspec.MsgspecError, ValueError):  # a bad utf-8 key: UnicodeDecodeError
            return self.decode_checked(data)
        msg = msgspec.to_builtins(batch, builtin_types=(bytes,))
        try:
            return unpack_columns(msg)
        except ProtocolError as e:
            raise self._fail("columns", str(e)) from None

    def decode_checked(self, data: bytes) -> dict[str, Any]:
        """``decode``'s checked path: msgpack to plain maps, then ``validate``."""
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
