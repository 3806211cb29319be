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
"""

from __future__ import annotations

import bisect
import collections
import os
import struct
import time
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import msgpack
import zstandard

from engine.events.schema import PROTOCOL_VERSION, READABLE_VERSIONS, ProtocolError
from engine.events.state import KVState
from engine.events.wire.codec import Codec

MAGIC = b"KVSTRACE"
TRAILER_MAGIC = b"KVSINDEX"
FORMAT_VERSION = 1
_FILE_HEAD = struct.Struct(">8sII")
_FRAME_HEAD = struct.Struct(">cIII")
_TRAILER = struct.Struct(">8sQ")
KEYFRAME, DELTAS, INDEX = b"K", b"D", b"I"
# No single frame of a sane recording comes near this; a corrupt length field does.
MAX_FRAME_BYTES = 1 << 30
RECENT_DELTA_FRAMES = 4  # decoded delta frames (<= 64 steps each) a Recording keeps


class RecordingError(ProtocolError):
    """A file that is not a readable kvscope recording (the message names the file)."""


class RecordingWarning(UserWarning):
    """A recording that was not closed cleanly (read up to its last complete frame)."""


class RecordingWriter:
    """Writes a .kvtrace file. Call ``add(batch, state)`` per batch, ``close()`` at the end.

    ``state`` is the KVState *after* the batch: the writer snapshots it when a keyframe
    is due (every ``keyframe_every_steps`` steps or ``keyframe_every_s`` seconds). A
    writer without a mirror (the EventStream) passes no state, watches ``keyframe_due``
    and hands a snapshot to ``keyframe()`` when it has one (at a later step boundary).
    Not thread-safe: one thread writes (the EventStream's publisher thread, or the record
    CLI).
    """

    def __init__(self, path: str | os.PathLike, header: dict[str, Any] | None = None, *,
                 keyframe_every_steps: int = 200, keyframe_every_s: float = 10.0,
                 chunk_steps: int = 64, chunk_s: float = 1.0, level: int = 3) -> None:
        self.path = Path(path)
        self.keyframe_every_steps = keyframe_every_steps
        self.keyframe_every_s = keyframe_every_s
        self.chunk_steps = chunk_steps
        self.chunk_s = chunk_s
        self._codec = Codec()
        self._zstd = zstandard.ZstdCompressor(level=level)
        self._file: BinaryIO | None = open(self.path, "wb")  # noqa: SIM115 (owned)
        self._index: list[list[Any]] = []
        self._pending: list[bytes] = []
        self._pending_steps: list[int] = []
        self._pending_seq: list[int] = []
        self._pending_since = 0.0
        self._last_key_step: int | None = None
        self._last_step = -1
        self._last_key_time = 0.0
        self.bytes_written = 0
        head = {"format": FORMAT_VERSION, "protocol": PROTOCOL_VERSION, "created": time.time(),
                "engine": {}, "model": None, **(header or {})}
        blob = msgpack.packb(head, use_bin_type=True)
        self._write(_FILE_HEAD.pack(MAGIC, FORMAT_VERSION, len(blob)) + blob)

    @property
    def closed(self) -> bool:
        return self._file is None

    @property
    def keyframe_due_by_time(self) -> bool:
        return time.monotonic() - self._last_key_time >= self.keyframe_every_s

    @property
    def keyframe_due(self) -> bool:
        """A keyframe is wanted (interval in steps or seconds passed since the last)."""
        return self._last_key_step is None or (
            self._last_step - self._last_key_step >= self.keyframe_every_steps
            or time.monotonic() - self._last_key_time >= self.keyframe_every_s)

    def add(self, batch: dict[str, Any], state: KVState | None = None,
            payload: bytes | None = None) -> None:
        """Append one batch (``payload`` = its encoded bytes, if already at hand)."""
        if self._file is None:
            raise RecordingError(f"{self.path}: recording is closed")
        now = time.monotonic()
        if not self._pending:
            self._pending_since = now
        self._pending.append(payload if payload is not None else self._codec.encode(batch))
        self._pending_steps.append(int(batch["step"]))
        self._pending_seq.append(int(batch.get("seq", 0)))
        self._last_step = int(batch["step"])
        if state is not None and self.keyframe_due:
            self.keyframe(state, int(batch.get("seq", 0)), str(batch.get("epoch", "")))
        elif (len(self._pending) >= self.chunk_steps
              or now - self._pending_since >= self.chunk_s):
            self.flush()

    def keyframe(self, state: KVState | dict[str, Any], seq: int, epoch: str = "") -> None:
        """Write the full state (after its step, batch ``seq``) as a keyframe: a KVState
        or its ``snapshot()`` form."""
        self.flush()
        snap = state.snapshot() if isinstance(state, KVState) else state
        body = self._codec.encode({"epoch": epoch, "seq": seq, "state": snap})
        self._frame(KEYFRAME, {"step": snap["step"], "seq": seq}, body)
        self._last_key_step = self._last_step = snap["step"]
        self._last_key_time = time.monotonic()

    def flush(self) -> None:
        """Write the buffered deltas as one frame."""
        if not self._pending or self._file is None:
            return
        steps = self._pending_steps
        meta: dict[str, Any] = {"first": steps[0], "last": steps[-1], "n": len(steps),
                                "seq": [self._pending_seq[0], self._pending_seq[-1]]}
        if steps != list(range(steps[0], steps[0] + len(steps))):
            meta["steps"] = list(steps)
        self._frame(DELTAS, meta, b"".join(self._pending))
        self._pending, self._pending_steps, self._pending_seq = [], [], []

    def close(self) -> None:
        """Flush, write the index and the trailer. Idempotent."""
        if self._file is None:
            return
        self.flush()
        offset = self._file.tell()
        self._frame(INDEX, {}, msgpack.packb(self._index, use_bin_type=True), index=False)
        self._write(_TRAILER.pack(TRAILER_MAGIC, offset))
        self._file.close()
        self._file = None

    def __enter__(self) -> RecordingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _frame(self, kind: bytes, meta: dict[str, Any], body: bytes, index: bool = True) -> None:
        assert self._file is not None
        offset = self._file.tell()
        m = msgpack.packb(meta, use_bin_type=True)
        z = self._zstd.compress(body)
        crc = zlib.crc32(z, zlib.crc32(m))
        # one write per frame, then flush: a killed writer leaves whole frames behind
        self._write(_FRAME_HEAD.pack(kind, len(m), len(z), crc) + m + z)
        self._file.flush()
        if index:
            self._index.append([kind.decode(), offset, meta])

    def _write(self, data: bytes) -> None:
        assert self._file is not None
        self._file.write(data)
        self.bytes_written += len(data)


class Recording:
    """Reads a .kvtrace file: ``header``, ``steps``, ``state_at(step)``, batch iteration.

    Opening reads the header and the index (or rebuilds it, warning, when the writer did
    not close). Seeking costs one keyframe plus at most ``keyframe_every_steps`` deltas.
    Not thread-safe (one file position): give each thread its own Recording.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            self._file: BinaryIO = open(self.path, "rb")  # noqa: SIM115 (owned)
        except OSError as e:
            raise RecordingError(f"{self.path}: cannot open recording ({e.strerror})") from e
        self._dctx = zstandard.ZstdDecompressor()
        # the last few decoded delta frames, by offset: a seek reads its keyframe's
        # deltas and then (the replay's event-log context) most of the same frames again
        self._recent: collections.OrderedDict[int, list[dict[str, Any]]] = (
            collections.OrderedDict())
        self.truncated = False
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
        """The state at the end of ``step``: after every batch with a step <= ``step``."""
        i = bisect.bisect_right(self._key_steps, step) - 1
        if i < 0:
            first = self._key_steps[0] if self._key_steps else None
            raise RecordingError(
                f"{self.path}: no keyframe at or before step {step} (first: {first})")
        key_step, offset = self._keys[i]
        body = self._read_body(offset, KEYFRAME)
        state = KVState.from_snapshot(body["state"])
        for batch in self.batches(start_step=key_step + 1, end_step=step):
            state.apply(batch)
        return state

    def batches(self, start_step: int | None = None,
                end_step: int | None = None) -> Iterator[dict[str, Any]]:
        """Batches with ``start_step <= step <= end_step`` (either bound optional), in order."""
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

    def _read_header(self) -> dict[str, Any]:
        head = self._file.read(_FILE_HEAD.size)
        if len(head) < _FILE_HEAD.size or head[:8] != MAGIC:
            raise self._error(f"not a kvscope recording (starts with {head[:8]!r})")
        _, version, n = _FILE_HEAD.unpack(head)
        if version != FORMAT_VERSION:
            raise self._error(f"recording format {version}, this reader reads {FORMAT_VERSION}")
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
        return kind, meta, z

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
            frames = msgpack.unpackb(self._decompress(frame[2]), raw=False)
        except Exception:
            return None
        return frames

    def _scan(self) -> list[list[Any]]:
        """Rebuild the index from frame headers; stop (and warn) at the first bad frame."""
        frames: list[list[Any]] = []
        offset = self._frames_start
        while offset < self.size:
            frame = self._read_frame(offset)
            if frame is None or frame[0] not in (KEYFRAME, DELTAS, INDEX):
                self.truncated = True
                break
            kind, meta, z = frame
            if kind == INDEX:
                break
            frames.append([kind.decode(), offset, meta])
            offset = self._file.tell()
        why = ("is truncated or corrupt after byte " + str(offset) if self.truncated
               else "has no index (the writer did not close it)")
        warnings.warn(f"{self.path}: recording {why}; read {len(frames)} complete frames",
                      RecordingWarning, stacklevel=3)
        return frames

    def _decompress(self, z: bytes) -> bytes:
        """Bounded: a frame that claims (or unpacks to) more than MAX_FRAME_BYTES is an
        error, not an allocation (zstd honours a declared content size otherwise)."""
        chunks, total = [], 0
        try:
            with self._dctx.stream_reader(z) as reader:
                while chunk := reader.read(1 << 20):
                    total += len(chunk)
                    if total > MAX_FRAME_BYTES:
                        raise self._error(f"a frame unpacks to more than {MAX_FRAME_BYTES} "
                                          "bytes")
                    chunks.append(chunk)
        except zstandard.ZstdError as e:
            raise self._error(f"corrupt compressed frame ({e})") from None
        return b"".join(chunks)

    def _read_body(self, offset: int, kind: bytes) -> dict[str, Any]:
        frame = self._read_frame(offset)
        if frame is None or frame[0] != kind:
            raise self._error(f"frame at byte {offset} is unreadable")
        try:
            body = msgpack.unpackb(self._decompress(frame[2]), raw=False, strict_map_key=True)
        except RecordingError:
            raise
        except Exception as e:
            raise self._error(f"frame at byte {offset} is not valid msgpack ({e})") from None
        return body

    def _read_deltas(self, offset: int) -> list[dict[str, Any]]:
        """The frame's batches (shared with the small cache of recent frames: readers
        must not mutate them)."""
        cached = self._recent.get(offset)
        if cached is not None:
            self._recent.move_to_end(offset)
            return cached
        batches = self._decode_deltas(offset)
        self._recent[offset] = batches
        if len(self._recent) > RECENT_DELTA_FRAMES:
            self._recent.popitem(last=False)
        return batches

    def _decode_deltas(self, offset: int) -> list[dict[str, Any]]:
        frame = self._read_frame(offset)
        if frame is None or frame[0] != DELTAS:
            raise self._error(f"delta frame at byte {offset} is unreadable")
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=True,
                                    max_buffer_size=MAX_FRAME_BYTES)
        unpacker.feed(self._decompress(frame[2]))
        try:
            return list(unpacker)
        except Exception as e:
            raise self._error(f"delta frame at byte {offset} is not valid msgpack ({e})") from None
