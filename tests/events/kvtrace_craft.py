"""Take a .kvtrace apart into frames and put it back together with valid checksums: the
tools for crafting hostile recordings in a test (nothing large is committed)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import msgpack
import zstandard

from kvscope.engine.events.wire.recording import (
    _FILE_HEAD,
    _FRAME_HEAD,
    _TRAILER,
    INDEX,
    MAGIC,
    TRAILER_MAGIC,
)


@dataclass
class Frame:
    kind: bytes
    meta: dict
    z: bytes  # the compressed payload

    @property
    def body(self) -> bytes:
        return zstandard.ZstdDecompressor().decompressobj().decompress(self.z)

    def with_body(self, body: bytes) -> Frame:
        return Frame(self.kind, self.meta, zstandard.ZstdCompressor().compress(body))


def parse(data: bytes) -> tuple[dict, list[Frame]]:
    """(header, the K and D frames) of an intact recording."""
    _, _, n = _FILE_HEAD.unpack_from(data)
    pos = _FILE_HEAD.size
    header = msgpack.unpackb(data[pos:pos + n])
    pos += n
    frames = []
    while pos + _FRAME_HEAD.size <= len(data):
        kind, mlen, plen, _ = _FRAME_HEAD.unpack_from(data, pos)
        if kind == INDEX:
            break
        pos += _FRAME_HEAD.size
        meta = msgpack.unpackb(data[pos:pos + mlen])
        frames.append(Frame(kind, meta, data[pos + mlen:pos + mlen + plen]))
        pos += mlen + plen
    return header, frames


def build(header: dict, frames: list[Frame], index: bool = True) -> bytes:
    """A recording of these frames, every checksum valid; with an index and trailer."""
    blob = msgpack.packb(header)
    out = bytearray(_FILE_HEAD.pack(MAGIC, 1, len(blob)) + blob)
    entries = []
    for f in frames:
        entries.append([f.kind.decode(), len(out), f.meta])
        out += _frame(f.kind, f.meta, f.z)
    if index:
        at = len(out)
        out += _frame(INDEX, {}, zstandard.ZstdCompressor().compress(msgpack.packb(entries)))
        out += _TRAILER.pack(TRAILER_MAGIC, at)
    return bytes(out)


def _frame(kind: bytes, meta: dict, z: bytes) -> bytes:
    m = msgpack.packb(meta)
    return _FRAME_HEAD.pack(kind, len(m), len(z), zlib.crc32(z, zlib.crc32(m))) + m + z


def zstd_bomb(size: int) -> bytes:
    """One zstd frame of ``size`` zero bytes (1 GiB: ~33 KB), streamed: never held."""
    c = zstandard.ZstdCompressor(level=1).compressobj()
    zero, out = bytes(1 << 20), bytearray()
    for _ in range(size >> 20):
        out += c.compress(zero)
    return bytes(out + c.flush())
