"""RecordingWriter: writes a .kvtrace file (recording.py's docstring has the layout;
recording_format.py its constants). Torch-free."""

from __future__ import annotations

import os
import time
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import msgpack
import zstandard

from kvscope.engine.events.schema import PROTOCOL_VERSION
from kvscope.engine.events.state import KVState
from kvscope.engine.events.wire.codec import Codec
from kvscope.engine.events.wire.recording_format import (
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
)


class RecordingWriter:
    """Writes a .kvtrace file. Call ``add(batch, state)`` per batch, ``close()`` at the end.

    ``state`` is the KVState *after* the batch: the writer snapshots it when a keyframe
    is due (every ``keyframe_every_steps`` steps or ``keyframe_every_s`` seconds). A
    writer without a mirror (the EventStream) passes no state, watches ``keyframe_due``
    and hands a snapshot to ``keyframe()`` when it has one (at a later step boundary).
    Not thread-safe: one thread writes (the EventStream's publisher thread, or the record
    CLI).

    A write that fails (disk full, I/O error) closes the file at once (without its index:
    a reader rebuilds it and reads up to the last whole frame), sets ``error`` and raises
    that OSError; the writer is then closed, and ``close()`` does nothing more, so a
    failing disk raises once, never again at close.
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
        self.error: str | None = None  # why the recording stopped early (a failed write)
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

    def flush_if_stale(self) -> None:
        """Write the buffered deltas if the oldest waited ``chunk_s``: called while the
        engine is idle, so an idle engine's last steps are on disk, not in memory, when
        its process is killed (vLLM kills its engine core 5 s after asking it to stop)."""
        if self._pending and time.monotonic() - self._pending_since >= self.chunk_s:
            self.flush()

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
        f, self._file = self._file, None
        try:
            f.close()  # flushes the trailer: a full disk can still fail here
        except OSError as e:
            self.error = str(e)
            raise

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
        try:
            self._file.flush()
        except OSError as e:
            self._fail(e)
            raise
        if index:
            self._index.append([kind.decode(), offset, meta])

    def _write(self, data: bytes) -> None:
        assert self._file is not None
        try:
            self._file.write(data)
        except OSError as e:
            self._fail(e)
            raise
        self.bytes_written += len(data)

    def _fail(self, err: OSError) -> None:
        """A write failed: close the file now (its buffered bytes are lost; the frames
        already flushed stay readable) and remember why."""
        self.error = str(err)
        f, self._file = self._file, None
        if f is not None:
            try:
                f.close()  # flushes the buffer again, which fails again: the fd is closed
            except OSError:
                pass
