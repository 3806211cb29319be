"""The mirror's storage: each tier's block columns (``TierState``), each sequence's
record (``SeqState``) and the wire form of block-id lists.

A tier is flat per-block arrays: ref count, prefix-cache hash (value + presence), owner,
per-block format and the step of the last change. Each array is a ``Column``: a numpy
view (bulk reads and writes: block maps, snapshots, large events) over an
``array.array`` (scalar reads and writes, cheaper than numpy's for the few-block events
that dominate a decode step) sharing the same memory, so either side sees every write of
the other.

Invariants of this storage (the meaning of events is ``KVState.apply``'s, not this
module's; nothing here raises for a block's state, only for malformed input):
- a tier's columns all have ``num_blocks`` entries, at most ``MAX_TIER_BLOCKS``, and a
  mirror's tiers hold at most ``MAX_TOTAL_BLOCKS`` blocks together (``KVState``);
- ``hash_c[b]`` means something only where ``hashed_c[b]`` is 1; a hash outside int64
  lives in ``big_hashes`` (and ``hash_c[b]`` is 0 there);
- ``fmt_c[b]`` indexes ``format_names``, whose entry 0 is the tier's own format;
- ``version`` changes whenever a block does (``mark`` is called before the change), so
  an unchanged ``version`` means unchanged columns;
- ``owner_c`` is display only: never part of ``canonical()``.
"""

from __future__ import annotations

import struct
import sys
import zlib
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvscope.engine.events.schema import ProtocolError

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
# owner column: held, but not by the sequence that took it (engine.events.state's docstring)
ORPHAN = -2
NEVER = -(1 << 30)  # last-change column of a block no event has touched (ages are huge)
# The largest tier a mirror builds (26 bytes of columns a block: ~110 MiB here). A real
# cache is far smaller (a 1M-block pool is huge); a 30-byte tier_init from a hostile file
# or publisher must not make the reader allocate gigabytes.
MAX_TIER_BLOCKS = 1 << 22
# The most blocks a mirror holds over all its pools together (every tier and cache
# group: 26 bytes a block, ~208 MiB at the cap). The per-pool cap alone let 192 pools
# (3 tiers x 64 groups) at 4M blocks each ask for ~20 GB in one 1.5 KB batch. A batch
# (or snapshot) whose declared geometry passes this is refused before anything is
# allocated (``KVState.apply``, ``KVState.from_snapshot``).
MAX_TOTAL_BLOCKS = 1 << 23
# The most live sequences a mirror holds (a SeqState is ~0.6 KB with its dict entry:
# ~160 MiB at the cap). A real engine's waiting + running queues are far smaller; a
# ``seq_add`` flood past it is refused, batch by batch, with the state unchanged.
MAX_SEQS = 1 << 18
_LITTLE = sys.byteorder == "little"
SMALL_IDS = 24  # an id list longer than this takes the numpy path (both views agree)
# little-endian int32 x k, for unpacking the short id lists of most events
_SMALL_UNPACK = tuple(struct.Struct(f"<{k}i") for k in range(33))


def seq_owner_id(seq_id: str) -> int:
    """The owner id a block map stores for a sequence: crc32 of its id (stable across
    runs, seeks and snapshots; ``% n`` gives the inspector's colour slot)."""
    return zlib.crc32(seq_id.encode())


def pack_ids(ids: Any) -> bytes:
    """Block ids -> packed little-endian int32 (the v2 wire form of id lists)."""
    a = array("i", ids)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack_ids(value: Any) -> list[int]:
    """A wire id list (v1: list of ints; v2: packed little-endian int32 bytes) -> list.

    Raises ProtocolError for anything else (bools, floats, strings, ragged bytes)."""
    if type(value) is bytes:  # the common case, short: one precompiled struct unpack
        n = len(value)
        if n < 4 * len(_SMALL_UNPACK) and not n & 3:
            return list(_SMALL_UNPACK[n >> 2].unpack(value))
    if isinstance(value, (bytes, bytearray, memoryview)):
        if len(value) % 4:
            raise ProtocolError(f"packed id list of {len(value)} bytes is not int32s")
        a = array("i")
        a.frombytes(value)
        if not _LITTLE:
            a.byteswap()
        return a.tolist()
    if type(value) is not list:
        raise ProtocolError(f"id list is a {type(value).__name__}")
    for b in value:
        if type(b) is not int:  # bool is an int subclass: numpy would read it as a mask
            raise ProtocolError(f"block id {b!r} is not an int")
    return value


class Column:
    """One per-block array: ``np`` (numpy view) and ``py`` (array.array), same memory."""

    __slots__ = ("py", "np")

    def __init__(self, typecode: str, n: int, fill: int = 0) -> None:
        self.py = array(typecode, [fill]) * n if n else array(typecode)
        self.np = np.frombuffer(self.py, dtype=self.py.typecode) if n else np.zeros(
            0, dtype=np.dtype(typecode))

    @classmethod
    def of(cls, typecode: str, values: np.ndarray) -> Column:
        c = cls(typecode, len(values))
        if len(values):
            c.np[:] = values
        return c

    def copy(self) -> Column:
        return Column.of(self.py.typecode, self.np)


class _HashView(Mapping):
    """Read-only ``{block: hash}`` view of a tier's cached blocks (for hover/inspector)."""

    def __init__(self, t: TierState) -> None:
        self._t = t

    def __getitem__(self, b: int) -> int:
        t = self._t
        if not isinstance(b, int) or not 0 <= b < t.num_blocks or not t.hashed_c.py[b]:
            raise KeyError(b)
        return t.big_hashes.get(b, t.hash_c.py[b])

    def __contains__(self, b: object) -> bool:
        t = self._t
        return isinstance(b, int) and 0 <= b < t.num_blocks and bool(t.hashed_c.py[b])

    def __iter__(self) -> Iterator[int]:
        return iter(np.flatnonzero(self._t.hashed_c.np).tolist())

    def __len__(self) -> int:
        return int(np.count_nonzero(self._t.hashed_c.np))


class TierState:
    """One physical block pool as columns (see the module docstring)."""

    def __init__(self, name: str, num_blocks: int, block_size: int,
                 format: str = "auto") -> None:  # noqa: A002 - the wire field's name
        self.name, self.num_blocks, self.block_size, self.format = (
            name, num_blocks, block_size, format)
        n = num_blocks
        self.ref_c = Column("i", n)
        self.hashed_c = Column("B", n)  # 1 = the block holds a prefix-cache hash
        self.hash_c = Column("q", n)
        self.owner_c = Column("q", n, -1)
        self.fmt_c = Column("B", n)  # index into self.format_names; 0 = the tier's format
        self.touched_c = Column("i", n, NEVER)  # step of the last change to the block
        self.big_hashes: dict[int, int] = {}  # hashes outside int64 (foreign producers)
        self.format_names: list[str] = [format]
        # bumped by every change to a block (a rejected batch may bump it too): readers
        # that redraw per frame skip an unchanged tier; clone(reuse=) shares it
        self.version = 0
        self._source: tuple[int, int] | None = None  # (id, version) of the tier cloned
        # ids changed since the last KVState.clone (None: too many, copy whole)
        self._dirty: list[list[int]] | None = []
        self._dirty_n = 0
        self.changed_since: tuple[int, np.ndarray] | None = None  # see refresh_from

    # numpy views, for readers (block maps, tests)
    @property
    def ref(self) -> np.ndarray:
        return self.ref_c.np

    @property
    def owner(self) -> np.ndarray:
        return self.owner_c.np

    @property
    def touched(self) -> np.ndarray:
        return self.touched_c.np

    @property
    def hashes(self) -> Mapping[int, int]:
        return _HashView(self)

    def block_format_codes(self) -> np.ndarray:
        """uint8 per block: index into ``format_names`` (0 = the tier's format)."""
        return self.fmt_c.np

    @property
    def formats(self) -> dict[int, str]:
        """{block: format} of the blocks whose format differs from the tier's (demoted)."""
        return self.block_formats()

    def block_formats(self) -> dict[int, str]:
        """{block: format} for blocks whose format differs from the tier's."""
        names = self.format_names
        idx = np.flatnonzero(self.fmt_c.np)
        return {b: names[c] for b, c in zip(idx.tolist(), self.fmt_c.np[idx].tolist(),
                                              strict=True) if names[c] != self.format}

    def hash_list(self) -> list[int | None]:
        """Per block: its hash, or None (the canonical form)."""
        out = [h if m else None for h, m in zip(self.hash_c.py, self.hashed_c.py, strict=True)]
        for b, h in self.big_hashes.items():
            out[b] = h
        return out

    def columns(self) -> tuple[Column, ...]:
        return (self.ref_c, self.hashed_c, self.hash_c, self.owner_c, self.fmt_c,
                self.touched_c)

    def clone(self) -> TierState:
        t = TierState.__new__(TierState)
        t.name, t.num_blocks, t.block_size, t.format = (
            self.name, self.num_blocks, self.block_size, self.format)
        t.ref_c, t.hashed_c, t.hash_c, t.owner_c, t.fmt_c, t.touched_c = (
            c.copy() for c in self.columns())
        t.big_hashes = dict(self.big_hashes)
        t.format_names = list(self.format_names)
        t.version, t._source = self.version, (id(self), self.version)
        t._dirty, t._dirty_n, t.changed_since = [], 0, None
        return t

    def mark(self, ids: list[int]) -> None:
        """Blocks ``ids`` change (called before the change; see ``version``)."""
        self.version += 1
        if self._dirty is not None:
            self._dirty_n += len(ids)
            if self._dirty_n > self.num_blocks // 4:
                self._dirty = None
            else:
                self._dirty.append(ids)

    def refresh_from(self, src: TierState) -> None:
        """Make this clone of ``src`` (taken at its last ``KVState.clone``) equal to it
        again, copying only the blocks changed since."""
        # id lists (per-event apply) and int arrays (columnar apply)
        parts = src._dirty
        idx = np.fromiter((b for ids in parts if type(ids) is list for b in ids),
                          dtype=np.int64)
        arrays = [a for a in parts if type(a) is not list]
        if arrays:
            idx = np.concatenate([idx, *arrays]).astype(np.int64, copy=False)
        for dst_c, src_c in zip(self.columns(), src.columns(), strict=True):
            dst_c.np[idx] = src_c.np[idx]
        self.format, self.format_names = src.format, list(src.format_names)
        self.big_hashes = dict(src.big_hashes)
        self.changed_since = (self.version, idx)  # (version before, ids changed)
        self.version, self._source = src.version, (id(src), src.version)

    def check_ids(self, ids: list[int]) -> None:
        n = self.num_blocks
        if len(ids) == 1:  # most events: one compare, not min() and max()
            if not 0 <= ids[0] < n:
                raise ProtocolError(f"tier {self.name}: block id {ids[0]!r} out of range")
        elif ids and (min(ids) < 0 or max(ids) >= n):
            bad = next(b for b in ids if not 0 <= b < n)
            raise ProtocolError(f"tier {self.name}: block id {bad!r} out of range")

    def set_hash(self, b: int, h: int) -> None:
        if _INT64_MIN <= h <= _INT64_MAX:
            self.hash_c.py[b] = h
            self.big_hashes.pop(b, None)
        else:
            self.hash_c.py[b] = 0
            self.big_hashes[b] = h
        self.hashed_c.py[b] = 1

    def hash_value(self, b: int) -> int:
        return self.big_hashes[b] if self.big_hashes and b in self.big_hashes else (
            self.hash_c.py[b])


@dataclass
class SeqState:
    """One sequence as the cache sees it."""

    seq_id: str
    status: str = "waiting"
    tier: str = "gpu"
    block_table: list[int] = field(default_factory=list)
    num_tokens: int = 0
    prompt_tokens: int = 0
    priority: int = 0
    parent: str | None = None
    preemptions: int = 0
    hit_tokens: int = 0
    owner_id: int = -1
    # tables of KV cache groups other than 0 (hybrid cache: group 1, the sliding-window
    # layers' held blocks, oldest first; pool ``schema.group_pool(tier, group)``). Handlers
    # replace the dict and its lists, never mutate them: the undo log keeps the old ones.
    group_tables: dict[int, list[int]] = field(default_factory=dict)


def format_code(t: TierState, fmt: str) -> int:
    """Index of ``fmt`` in the tier's format names (appended when new; 0 = tier format)."""
    if fmt == t.format:
        return 0
    try:
        return t.format_names.index(fmt)
    except ValueError:
        if len(t.format_names) >= 255:
            raise ProtocolError(f"tier {t.name}: too many distinct formats") from None
        t.format_names.append(fmt)
        return len(t.format_names) - 1
