"""Recordings of a vLLM-format KV-event stream (``.vllmtrace``): the raw messages, so a
replay decodes exactly what was on the wire.

File: a msgpack stream. First a header map ``{"format": "kvscope-vllm-events", "v": 1,
"source": endpoint}``, then one array per message ``[recv_time, topic, seq_bytes,
payload]`` (bytes kept verbatim). A truncated tail (a recorder killed mid-write) is
ignored: the messages before it stay readable.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import msgpack

from kvscope.engine.events.vllm.kv_events_subscriber import VllmBatch, decode_frames
from kvscope.engine.events.vllm.kv_events_wire import VllmWireError

FORMAT = "kvscope-vllm-events"
VERSION = 1


class VllmRecordingWriter:
    def __init__(self, path: str | Path, source: str = "") -> None:
        self._f: BinaryIO = open(path, "wb")  # noqa: SIM115 - closed in close()
        self._packer = msgpack.Packer(use_bin_type=True)
        self._f.write(self._packer.pack({"format": FORMAT, "v": VERSION, "source": source}))
        self.messages = 0

    def write(self, topic: bytes, seq_bytes: bytes, payload: bytes,
              recv_time: float | None = None) -> None:
        t = time.time() if recv_time is None else recv_time
        self._f.write(self._packer.pack([t, topic, seq_bytes, payload]))
        self.messages += 1

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> VllmRecordingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_messages(path: str | Path) -> tuple[dict[str, Any], list[list[Any]]]:
    """(header, [[recv_time, topic, seq_bytes, payload], ...]). Raises ValueError."""
    with open(path, "rb") as f:
        unpacker = msgpack.Unpacker(f, raw=False, max_buffer_size=64 << 20)
        try:
            header = next(unpacker)
        except (StopIteration, ValueError, msgpack.ExtraData) as e:
            raise ValueError(f"{path}: not a vLLM event recording ({e})") from None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ValueError(f"{path}: not a vLLM event recording (no {FORMAT} header)")
        out = []
        try:
            for item in unpacker:
                if (isinstance(item, list) and len(item) == 4
                        and all(isinstance(x, bytes) for x in item[1:])):
                    out.append(item)
        except (ValueError, msgpack.OutOfData):
            pass  # a truncated tail
    return header, out


def read_batches(path: str | Path) -> Iterator[VllmBatch | VllmWireError]:
    """Decoded batches in file order; an undecodable message yields its error instead."""
    _, messages = read_messages(path)
    for t, topic, seq_bytes, payload in messages:
        try:
            yield decode_frames(topic, seq_bytes, payload, recv_time=t)
        except VllmWireError as e:
            yield e
