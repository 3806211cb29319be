"""Recordings (.kvtrace): the event stream in a file, seekable to any step.

File layout (all integers big-endian):

    magic     b"KVSTRACE"
    u32       FORMAT_VERSION
    u32 n     header length, then n bytes of msgpack header:
              {"format", "protocol", "created", "engine": {...}, "model": str|None, ...}
    frames    each: u8 kind | u32 meta_len | u32 payload_len | u32 crc32(meta+payload)
                    | meta (msgpack, uncompressed) | payload (one zstd frame)
        K keyframe  meta {"step", "seq"};  payload msgpack {"epoch", "seq", "state"}
                    (state = KVState.snapshot() after the batch with that step;
                    written by an EventStream, the cache manager's own snapshot)
        D deltas    meta {"first", "last", "n", "seq": [first, last], "steps"?}
                    ("steps" only when not the contiguous range first..last);
                    payload = the batch messages, msgpack-concatenated
        I index     meta {}; payload msgpack [[kind, offset, meta], ...] of every K/D frame
    trailer   b"KVSINDEX" + u64 offset of the I frame (written by close())

The header's "protocol" is the event protocol of the batches and keyframes inside:
readers take 1 (id lists as msgpack ints) and 2 (packed int32 id lists).

Invariants: frames appear in step order; a keyframe at step k follows every delta with
step <= k and precedes every delta with step > k. So ``state_at(s)`` = the last keyframe
at or before s, plus the deltas after it up to s.

A writer that was killed leaves no index: the reader rebuilds it by scanning frame
headers (verifying each CRC), stops at the first incomplete or corrupt frame, and warns.
Deltas still buffered in the writer (at most ``chunk_steps`` steps or ``chunk_s`` seconds)
are lost with it.

A recording is untrusted input (it is made to be shared). The reader bounds what any
file can make it allocate: a frame unpacks to at most ``frame_limit`` bytes (derived
from the header's block count, never over ``MAX_FRAME_BYTES``), a delta frame is decoded
one batch at a time, every batch is checked against the event schema (``Codec.decode``)
before anyone applies it, index entries are checked (types, order, a step count the
frame's size can hold) before they are trusted. A frame that fails ends the replay at the
last good step: ``batches()`` stops there, ``damage`` holds a one-line message and a
RecordingWarning says it once; ``state_at`` past the damage raises RecordingError.
"""

from __future__ import annotations

import bisect
import collections
import os
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import msgpack
import zstandard

from kvscope.engine.events.schema import READABLE_VERSIONS, ProtocolError
from kvscope.engine.events.state import KVState
from kvscope.engine.events.wire.codec import MSG_BATCH, Codec, check_envelope, typed_events
from kvscope.engine.events.wire.recording_format import (  # noqa: F401 (the module's names)
    _FILE_HEAD,
    _FRAME_HEAD,
    _TRAILER,
    DELTAS,
    FORMAT_VERSION,
    INDEX,
    KEYFRAME,
    MAGIC,
    TRAILER_MAGIC,
    RecordingError,
    RecordingWarning,
)
from kvscope.engine.events.wire.recording_writer import RecordingWriter  # noqa: F401

# What one frame may unpack to, whatever the file says. A keyframe of a 1M-block cache
# is ~10 MiB of msgpack and a 64-step delta frame of a busy engine a few MiB, so 64 MiB
# leaves room for every real recording and keeps a hostile one's cost bounded.
MAX_FRAME_BYTES = 64 << 20
# Below the cap, a frame's limit follows the header's geometry (``frame_limit``): a floor
# for the envelope, stats and sequences, plus this much per block (per step, for deltas):
# a block's ref, hash and table entries take ~20 bytes; 64 leaves room.
FRAME_FLOOR_BYTES = 1 << 20
BYTES_PER_BLOCK = 64
# The most steps one delta frame may claim (the writer writes 64); a frame must also
# hold a compressed byte per step (every batch has its own step and time), so the
# steps a file lists are bounded by its size.
MAX_STEPS_PER_FRAME = 1 << 16
RECENT_DELTA_FRAMES = 4  # decoded delta frames (<= 64 steps each) a Recording keeps


def header_blocks(header: dict[str, Any]) -> int | None:
    """The total block count the header states (the cache's geometry), or None when it
    states none: ``num_*blocks`` / ``*_blocks`` ints at its top level or under "engine",
    "config" or "geometry"."""
    total, found = 0, False
    for where in (header, header.get("engine"), header.get("config"),
                  header.get("geometry")):
        if not isinstance(where, dict):
            continue
        for key, value in where.items():
            if (isinstance(key, str) and key.endswith("blocks") and type(value) is int
                    and value > 0):
                total, found = total + value, True
    return total if found else None


def frame_limit(header: dict[str, Any], kind: bytes, steps: int = 1) -> int:
    """The most bytes a ``kind`` frame of ``steps`` steps may unpack to in a recording
    with this header: its geometry's share (``FRAME_FLOOR_BYTES`` + ``BYTES_PER_BLOCK``
    per block, per step for deltas), never over ``MAX_FRAME_BYTES``; the cap alone when
    the header states no geometry."""
    blocks = header_blocks(header)
    if blocks is None or kind == INDEX:
        return MAX_FRAME_BYTES
    per_frame = blocks * BYTES_PER_BLOCK * (max(1, steps) if kind == DELTAS else 1)
    return min(MAX_FRAME_BYTES, FRAME_FLOOR_BYTES + per_frame)


def recorded_batch(codec: Codec, data: bytes | memoryview) -> dict[str, Any]:
    """One recorded batch, checked before anyone applies it. A wire batch decodes on the
    codec's typed path (``Codec.decode``); a recording may also hold the bare batches a
    caller gave ``RecordingWriter.add`` ({v, step, events, time?, stats?}, no envelope),
    which must then have a readable ``v``, an int ``step``, a float ``time`` and a map of
    ``stats`` if any, and events each of its kind's type (``typed_events``)."""
    try:
        msg = codec.decode(data)
    except ProtocolError as wire_error:
        try:
            msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception:
            raise wire_error from None
        if not isinstance(msg, dict) or "type" in msg:
            raise
        v, step, events = msg.get("v"), msg.get("step"), msg.get("events")
        if (v not in READABLE_VERSIONS or isinstance(v, bool) or not _int(step)
                or not isinstance(events, list)
                or not isinstance(msg.get("time", 0.0), (int, float))
                or not isinstance(msg.get("stats", {}), dict)):
            raise
        check_envelope({"v": v, "type": MSG_BATCH, "epoch": "", "seq": 0, "step": step,
                        "time": 0.0, "events": events})  # each event a map with a kind
        msg["events"] = typed_events(events)
        return msg
    if msg["type"] != MSG_BATCH:
        raise ProtocolError(f"a {msg['type']} message among the batches")
    return msg


def _int(x: Any) -> bool:
    return type(x) is int and -(1 << 62) < x < (1 << 62)


class Recording:
    """Reads a .kvtrace file: ``header``, ``steps``, ``state_at(step)``, batch iteration.

    Opening reads the header and the index (or rebuilds it, warning, when the writer did
    not close). Seeking costs one keyframe plus at most ``keyframe_every_steps`` deltas.
    A damaged frame ends the replay at the last good step (``damage``; module docstring).
    Not thread-safe (one file position): give each thread its own Recording.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            self._file: BinaryIO = open(self.path, "rb")  # noqa: SIM115 (owned)
        except OSError as e:
            raise RecordingError(f"{self.path}: cannot open recording ({e.strerror})") from e
        self._dctx = zstandard.ZstdDecompressor()
        self._codec = Codec()
        # the last few decoded delta frames, by offset: a seek reads its keyframe's
        # deltas and then (the replay's event-log context) most of the same frames again
        self._recent: collections.OrderedDict[int, list[dict[str, Any]]] = (
            collections.OrderedDict())
        self.truncated = False
        self.damage: str | None = None  # one line: where the replay ends, and why
        try:
            self.size = os.fstat(self._file.fileno()).st_size
            self.header = self._read_header()
            frames = self._read_index()
            if frames is None:
                frames = self._scan()
        except BaseException:
            self._file.close()
            raise
        self._keys = [(m["step"], off) for k, off, m in frames if k == "K"]
        self._key_steps = [s for s, _ in self._keys]
        self._deltas = [(m["first"], m["last"], off, m) for k, off, m in frames if k == "D"]
        self._delta_lasts = [d[1] for d in self._deltas]
        self.steps: list[int] = []
        for first, last, _, m in self._deltas:
            self.steps.extend(m.get("steps") or range(first, last + 1))

    # ------------------------------------------------------------------ public
    @property
    def keyframe_steps(self) -> list[int]:
        return list(self._key_steps)

    def state_at(self, step: int) -> KVState:
        """The state at the end of ``step``: after every batch with a step <= ``step``.
        Raises RecordingError when a damaged frame stands between its keyframe and it."""
        i = bisect.bisect_right(self._key_steps, step) - 1
        if i < 0:
            first = self._key_steps[0] if self._key_steps else None
            raise RecordingError(
                f"{self.path}: no keyframe at or before step {step} (first: {first})")
        key_step, offset = self._keys[i]
        body = self._read_body(offset, KEYFRAME)
        try:
            state = KVState.from_snapshot(body.get("state") if isinstance(body, dict) else None)
            for batch in self._batches(start_step=key_step + 1, end_step=step):
                state.apply(batch)
        except RecordingError:
            raise
        except ProtocolError as e:
            raise self._error(f"cannot rebuild step {step}: {e}") from None
        return state

    def batches(self, start_step: int | None = None,
                end_step: int | None = None) -> Iterator[dict[str, Any]]:
        """Batches with ``start_step <= step <= end_step`` (either bound optional), in order,
        each checked against the event schema. Stops at a damaged frame (``damage``)."""
        last = None
        try:
            for batch in self._batches(start_step, end_step):
                last = batch["step"]
                yield batch
        except RecordingError as e:
            self._damaged(str(e), last)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self.batches()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Recording:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- reading
    def _error(self, text: str) -> RecordingError:
        return RecordingError(f"{self.path}: {text}")

    def _damaged(self, text: str, last: int | None) -> None:
        """Note (once) that the replay ends before ``text``'s frame."""
        if self.damage is not None:
            return
        where = f"after step {last}" if last is not None else "before its first step"
        self.damage = f"{text}; the replay ends {where}"
        warnings.warn(self.damage, RecordingWarning, stacklevel=3)

    def _batches(self, start_step: int | None,
                 end_step: int | None) -> Iterator[dict[str, Any]]:
        j = 0 if start_step is None else bisect.bisect_left(self._delta_lasts, start_step)
        for first, _last, offset, _ in self._deltas[j:]:
            if end_step is not None and first > end_step:
                return
            for batch in self._read_deltas(offset):
                step = batch["step"]
                if start_step is not None and step < start_step:
                    continue
                if end_step is not None and step > end_step:
                    return
                yield batch

    def _read_header(self) -> dict[str, Any]:
        head = self._file.read(_FILE_HEAD.size)
        if len(head) < _FILE_HEAD.size or head[:8] != MAGIC:
            raise self._error(f"not a kvscope recording (starts with {head[:8]!r})")
        _, version, n = _FILE_HEAD.unpack(head)
        if version != FORMAT_VERSION:
            raise self._error(f"recording format {version}, this reader reads {FORMAT_VERSION}")
        if n > min(self.size, MAX_FRAME_BYTES):
            raise self._error("header is truncated")
        blob = self._file.read(n)
        if len(blob) != n:
            raise self._error("header is truncated")
        try:
            header = msgpack.unpackb(blob, raw=False, strict_map_key=True)
        except Exception as e:
            raise self._error(f"header is not valid msgpack ({e})") from None
        if not isinstance(header, dict):
            raise self._error("header is not a map")
        if header.get("protocol") not in READABLE_VERSIONS:
            raise self._error(f"event protocol {header.get('protocol')!r}, this reader "
                              f"speaks {'/'.join(map(str, READABLE_VERSIONS))}")
        self._frames_start = self._file.tell()
        return header

    def _read_frame(self, offset: int) -> tuple[bytes, dict[str, Any], bytes] | None:
        """(kind, meta, compressed payload) at offset, or None if incomplete/corrupt."""
        self._file.seek(offset)
        head = self._file.read(_FRAME_HEAD.size)
        if len(head) < _FRAME_HEAD.size:
            return None
        kind, mlen, plen, crc = _FRAME_HEAD.unpack(head)
        if mlen + plen > MAX_FRAME_BYTES or offset + _FRAME_HEAD.size + mlen + plen > self.size:
            return None
        m = self._file.read(mlen)
        z = self._file.read(plen)
        if zlib.crc32(z, zlib.crc32(m)) != crc:
            return None
        try:
            meta = msgpack.unpackb(m, raw=False, strict_map_key=True)
        except Exception:
            return None
        if not isinstance(meta, dict):
            return None
        return kind, meta, z

    def _entry_ok(self, kind: Any, offset: Any, meta: Any, plen: int | None = None) -> bool:
        """An index entry (or a scanned frame's header) the reader may trust: its types,
        a step range that its step count matches, a count the frame can hold."""
        if not (_int(offset) and self._frames_start <= offset < self.size
                and isinstance(meta, dict)):
            return False
        if kind == "K":
            return _int(meta.get("step"))
        if kind != "D":
            return False
        first, last, n, steps = meta.get("first"), meta.get("last"), meta.get("n"), \
            meta.get("steps")
        if not (_int(first) and _int(last) and _int(n) and 1 <= n <= MAX_STEPS_PER_FRAME
                and first <= last and n <= (plen if plen is not None else self.size)):
            return False
        if steps is None:
            return last - first + 1 == n
        return (isinstance(steps, list) and len(steps) == n and all(map(_int, steps))
                and steps[0] == first and steps[-1] == last
                and all(a < b for a, b in zip(steps, steps[1:], strict=False)))

    def _checked(self, frames: Any) -> list[list[Any]] | None:
        """The index's entries if every one is trustworthy and they run in step order."""
        if not isinstance(frames, list):
            return None
        last_key, last_delta = None, None
        for entry in frames:
            if not (isinstance(entry, list) and len(entry) == 3
                    and self._entry_ok(*entry)):
                return None
            kind, _, meta = entry
            if kind == "K":
                if last_key is not None and meta["step"] < last_key:
                    return None
                last_key = meta["step"]
            else:
                if last_delta is not None and meta["first"] <= last_delta:
                    return None
                last_delta = meta["last"]
        return frames

    def _read_index(self) -> list[list[Any]] | None:
        if self.size < self._frames_start + _TRAILER.size:
            return None
        self._file.seek(self.size - _TRAILER.size)
        magic, offset = _TRAILER.unpack(self._file.read(_TRAILER.size))
        if magic != TRAILER_MAGIC or not self._frames_start <= offset < self.size:
            return None
        frame = self._read_frame(offset)
        if frame is None or frame[0] != INDEX:
            return None
        try:
            frames = msgpack.unpackb(self._decompress(frame[2], MAX_FRAME_BYTES), raw=False)
        except Exception:
            return None
        return self._checked(frames)

    def _scan(self) -> list[list[Any]]:
        """Rebuild the index from frame headers; stop (and warn) at the first bad frame."""
        frames: list[list[Any]] = []
        offset = self._frames_start
        last_key, last_delta = None, None
        while offset < self.size:
            frame = self._read_frame(offset)
            if frame is None or frame[0] not in (KEYFRAME, DELTAS, INDEX):
                self.truncated = True
                break
            kind, meta, z = frame
            if kind == INDEX:
                break
            entry = [kind.decode(), offset, meta]
            if not self._entry_ok(*entry, plen=len(z)) or (
                    kind == KEYFRAME and last_key is not None and meta["step"] < last_key) or (
                    kind == DELTAS and last_delta is not None and meta["first"] <= last_delta):
                self.truncated = True
                break
            if kind == KEYFRAME:
                last_key = meta["step"]
            else:
                last_delta = meta["last"]
            frames.append(entry)
            offset = self._file.tell()
        why = ("is truncated or corrupt after byte " + str(offset) if self.truncated
               else "has no index (the writer did not close it)")
        warnings.warn(f"{self.path}: recording {why}; read {len(frames)} complete frames",
                      RecordingWarning, stacklevel=3)
        return frames

    def _decompress(self, z: bytes, limit: int) -> bytes:
        """Bounded: a frame that unpacks to more than ``limit`` bytes is an error, not an
        allocation (read in 1 MiB pieces; a declared content size is not trusted)."""
        out, total = bytearray(), 0
        try:
            with self._dctx.stream_reader(z) as reader:
                while chunk := reader.read(min(1 << 20, limit + 1 - total)):
                    total += len(chunk)
                    if total > limit:
                        raise self._error(f"a frame unpacks to more than {limit} bytes "
                                          "(the most this recording's geometry needs)")
                    out += chunk
        except zstandard.ZstdError as e:
            raise self._error(f"corrupt compressed frame ({e})") from None
        return bytes(out)

    def _read_body(self, offset: int, kind: bytes) -> dict[str, Any]:
        frame = self._read_frame(offset)
        if frame is None or frame[0] != kind:
            raise self._error(f"frame at byte {offset} is unreadable")
        data = self._decompress(frame[2], frame_limit(self.header, kind))
        try:
            body = msgpack.unpackb(data, raw=False, strict_map_key=True)
        except Exception as e:
            raise self._error(f"frame at byte {offset} is not valid msgpack ({e})") from None
        return body

    def _read_deltas(self, offset: int) -> Iterator[dict[str, Any]]:
        """The frame's batches (shared with the small cache of recent frames: readers
        must not mutate them). A frame is at most ``frame_limit`` bytes and each batch
        is typed as it is decoded, so what it holds stays bounded."""
        cached = self._recent.get(offset)
        if cached is not None:
            self._recent.move_to_end(offset)
            yield from cached
            return
        batches: list[dict[str, Any]] = []
        try:
            # decoded whole even when the reader stops early (a seek's end step): the
            # log context asks for the same frame next
            batches.extend(self._decode_deltas(offset))
        except RecordingError:
            yield from batches  # the good batches before the damage, then the error
            raise
        self._recent[offset] = batches
        if len(self._recent) > RECENT_DELTA_FRAMES:
            self._recent.popitem(last=False)
        yield from batches

    def _decode_deltas(self, offset: int) -> Iterator[dict[str, Any]]:
        """Decode the delta frame at ``offset`` batch by batch: msgpack's ``skip`` finds
        where each batch ends without building it, then ``Codec.decode`` builds and checks
        that one batch against the schema. Raises RecordingError at the first bad one."""
        frame = self._read_frame(offset)
        if frame is None or frame[0] != DELTAS:
            raise self._error(f"delta frame at byte {offset} is unreadable (corrupt bytes)")
        n = frame[1].get("n")
        data = self._decompress(frame[2], frame_limit(self.header, DELTAS,
                                                      n if _int(n) else 1))
        unpacker = msgpack.Unpacker(max_buffer_size=max(1, len(data)))
        unpacker.feed(data)
        view, start, prev = memoryview(data), 0, None
        while start < len(data):
            try:
                unpacker.skip()
            except Exception as e:
                raise self._error(f"delta frame at byte {offset} is not valid msgpack "
                                  f"({type(e).__name__})") from None
            end = unpacker.tell()
            try:
                batch = recorded_batch(self._codec, view[start:end])
            except ProtocolError as e:
                raise self._error(f"delta frame at byte {offset}: {e}") from None
            if prev is not None and batch["step"] <= prev:
                raise self._error(f"delta frame at byte {offset}: step {batch['step']} "
                                  f"after step {prev}")
            prev, start = batch["step"], end
            yield batch
