"""KVState: the mirror of a kvscope KV cache, rebuilt from events.

``KVState.apply(batch)`` is the single definition of what each event means (the kinds
are listed in ``engine.events.schema``). The inspector draws from a KVState; the tests
rebuild one from the engine's events and compare ``canonical()`` with the engine's own
``kv_state()`` after every step.

The page table is held as flat per-tier arrays (``TierState``): ref count, prefix-cache
hash (value + presence), owner, per-block format and the step of the last change. Each
array is a ``Column``: a numpy view (bulk reads and writes: block maps, snapshots, large
events) over an ``array.array`` (scalar reads and writes, ~3x cheaper than numpy's for
the 1-8 block events that dominate a decode step) sharing the same memory. Sequence
bookkeeping stays in dicts.

Invariants the mirror keeps (and ``apply`` enforces, raising ProtocolError otherwise):
- every sequence's block table lives in one tier (``seq.tier``) and points at blocks of
  that tier with ref > 0;
- a block's ref count equals the number of block-table entries pointing at it;
- only blocks with ref 0 can be evicted; ``alloc``/``cow`` destinations are free
  (ref 0, no hash).
A batch is applied atomically: if any event in it is rejected, the state is unchanged
(an undo log of the old values at the ids each handler overwrites: cost in proportion to
what a batch touches, never to the cache's size).

Owner (display only, not part of ``canonical()``): one sequence holding the block, as
``seq_owner_id(seq)``: the one that took it from ref 0 (alloc, a hit on an unheld cached
block, cow/host_hit/swap destinations); -1 when nobody holds it; ``ORPHAN`` when its
taker released it while others still hold it (``resolve_owners`` finds a holder for
those with one pass over the tier's block tables, when a view asks). A state rebuilt from
a snapshot assigns each held block to the first sequence whose table points at it.
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

from kvscope.engine.events import schema as S
from kvscope.engine.events.schema import ProtocolError

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
ORPHAN = -2  # owner column: held, but not by the sequence that took it (see docstring)
NEVER = -(1 << 30)  # last-change column of a block no event has touched (ages are huge)
# The largest tier a mirror builds (26 bytes of columns a block: ~110 MiB here). A real
# cache is far smaller (a 1M-block pool is huge); a 30-byte tier_init from a hostile file
# or publisher must not make the reader allocate gigabytes.
MAX_TIER_BLOCKS = 1 << 22
_LITTLE = sys.byteorder == "little"
_SMALL = 24  # events with more ids than this take the numpy path
_DIRTY_SLACK = 4096  # see KVState._dirty_seqs
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


class Canonical(dict):
    """``canonical()``'s dict. Compares equal to a plain canonical dict in which a tier
    lacks ``block_formats`` exactly when this one's is empty: a producer that does not
    report per-block formats has every block in its tier's format. Any real difference
    (a block in another format on either side) still makes them unequal."""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, dict):
            return NotImplemented
        return _with_formats(self) == _with_formats(other)

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None  # type: ignore[assignment]


def _with_formats(canon: dict) -> dict:
    tiers = canon.get("tiers")
    if not isinstance(tiers, dict) or all(
            isinstance(t, dict) and "block_formats" in t for t in tiers.values()):
        return dict(canon)
    return {**canon, "tiers": {
        name: ({**t, "block_formats": {}} if isinstance(t, dict) and "block_formats" not in t
               else t) for name, t in tiers.items()}}


class KVState:
    """The cache mirror. ``clone()`` gives an independent copy (seek keyframes)."""

    ORPHAN = ORPHAN  # for the columnar apply, which cannot import this module

    def __init__(self) -> None:
        self.tiers: dict[str, TierState] = {}
        self.seqs: dict[str, SeqState] = {}
        self.step: int = -1
        self.time: float = 0.0
        self.stats: dict[str, Any] = {}
        self.kind_counts: dict[str, int] = {}  # cumulative events applied, by kind
        self.unknown_kinds: int = 0
        # batches in columns the fast path left to the per-event reference (it refuses
        # whatever it does not handle, an invalid batch included: see state_columns)
        self.columns_refused: int = 0
        self._undo: list[tuple] | None = None  # a list only while apply() runs
        self._cur_step = -1
        self._clones = 0  # clone() calls, and what changed since the last one:
        # sequences touched since the last clone (see clone(reuse=)); None: more than
        # the state holds plus _DIRTY_SLACK (a mirror nobody clones: the next clone
        # copies every sequence instead of remembering every id it ever saw)
        self._dirty_seqs: set[str] | None = set()
        self._clone_of: tuple[int, int] | None = None  # (id, clone number) of the source
        self._idx_key: list[int] | None = None
        self._idx_val: np.ndarray | None = None

    # ------------------------------------------------------------------ reading
    def block_codes(self, tier: str, idx: np.ndarray | None = None) -> np.ndarray:
        """uint8 state code per block (schema.BLOCK_*), vectorised for 1M-block maps;
        only of the blocks ``idx`` when given."""
        t = self.tiers[tier]
        ref = t.ref_c.np if idx is None else t.ref_c.np[idx]
        codes = t.hashed_c.np.copy() if idx is None else t.hashed_c.np[idx]
        codes[ref == 1] = S.BLOCK_USED
        codes[ref > 1] = S.BLOCK_SHARED
        return codes

    def owners(self, tier: str, block: int) -> list[str]:
        """Sequences whose block table points at ``block`` (for hover/click)."""
        return [
            s.seq_id for s in self.seqs.values() if s.tier == tier and block in s.block_table
        ]

    def canonical(self) -> Canonical:
        """Plain-dict form for equality checks; same shape as ``LLMEngine.kv_state()``."""
        return Canonical({
            "tiers": {
                name: {
                    "num_blocks": t.num_blocks,
                    "block_size": t.block_size,
                    "format": t.format,
                    "ref": t.ref_c.np.tolist(),
                    "hash": t.hash_list(),
                    "block_formats": t.block_formats(),
                }
                for name, t in sorted(self.tiers.items())
            },
            "seqs": {
                sid: {
                    "status": s.status,
                    "tier": s.tier,
                    "block_table": list(s.block_table),
                    "num_tokens": s.num_tokens,
                    **_group_tables(s.group_tables),
                }
                for sid, s in sorted(self.seqs.items())
            },
        })

    # ------------------------------------------------------------- snapshots
    def snapshot(self) -> dict[str, Any]:
        """Full state as a msgpack-friendly map (str keys only); see ``from_snapshot``.

        Protocol 2: id lists and ref counts are packed little-endian int32 bytes,
        hashes packed int64 (a list when one does not fit)."""
        tiers = {}
        for name, t in self.tiers.items():
            hashed = np.flatnonzero(t.hashed_c.np)
            hashes: Any = t.hash_c.np[hashed].astype("<i8").tobytes()
            if t.big_hashes:
                hashes = [t.hash_value(b) for b in hashed.tolist()]
            fmts = t.block_formats()
            tiers[name] = {
                "num_blocks": t.num_blocks, "block_size": t.block_size, "format": t.format,
                "ref": t.ref_c.np.astype("<i4").tobytes(),
                "hashed": hashed.astype("<i4").tobytes(), "hashes": hashes,
                "formatted": pack_ids(list(fmts)), "formats": list(fmts.values()),
            }
        return {
            "v": S.PROTOCOL_VERSION,
            "step": self.step,
            "time": self.time,
            "stats": self.stats,
            "tiers": tiers,
            "seqs": [
                {
                    "seq": s.seq_id, "status": s.status, "tier": s.tier,
                    "block_table": pack_ids(s.block_table), "num_tokens": s.num_tokens,
                    "prompt_tokens": s.prompt_tokens, "priority": s.priority,
                    "parent": s.parent, "preemptions": s.preemptions,
                    "hit_tokens": s.hit_tokens,
                    **({"group_tables": {str(g): pack_ids(t) for g, t in s.group_tables.items()}}
                       if s.group_tables else {}),
                }
                for s in self.seqs.values()
            ],
            "kind_counts": dict(self.kind_counts),
        }

    @classmethod
    def from_snapshot(cls, snap: dict[str, Any]) -> KVState:
        """A KVState from ``snapshot()`` form, protocol 1 (lists) or 2 (packed)."""
        if not isinstance(snap, dict) or snap.get("v") not in S.READABLE_VERSIONS:
            v = snap.get("v") if isinstance(snap, dict) else None
            raise ProtocolError(
                f"snapshot protocol version {v!r}, expected one of {S.READABLE_VERSIONS}")
        st = cls()
        try:
            st.step = int(snap["step"])
            st.time = float(snap.get("time", 0.0))
            st.stats = dict(snap.get("stats") or {})
            for name, t in snap["tiers"].items():
                n = int(t["num_blocks"])
                if not 0 <= n <= MAX_TIER_BLOCKS:
                    raise ProtocolError(f"snapshot tier {name}: bad size {n} blocks")
                tier = TierState(name, n, int(t["block_size"]), str(t["format"]))
                n = tier.num_blocks
                ref = t["ref"]
                ref = (np.frombuffer(ref, dtype="<i4") if isinstance(ref, bytes)
                       else np.asarray(ref, dtype=np.int64))
                if ref.shape != (n,):
                    raise ProtocolError(f"snapshot tier {name}: ref has {ref.shape} entries")
                tier.ref_c.np[:] = ref
                hashed = unpack_ids(t["hashed"])
                tier.check_ids(hashed)
                hashes = t["hashes"]
                if isinstance(hashes, bytes):  # packed int64: one numpy pass (seeks)
                    hv = np.frombuffer(hashes, dtype="<i8")
                    if len(hv) != len(hashed) or len(hashes) % 8:
                        raise ProtocolError(f"snapshot tier {name}: hashed and hashes differ")
                    idx = np.asarray(hashed, dtype=np.int64)
                    tier.hash_c.np[idx] = hv
                    tier.hashed_c.np[idx] = 1
                else:
                    hashes = [int(h) for h in hashes]
                    if len(hashes) != len(hashed):
                        raise ProtocolError(f"snapshot tier {name}: hashed and hashes differ")
                    for b, h in zip(hashed, hashes, strict=True):
                        tier.set_hash(b, h)
                formatted = unpack_ids(t.get("formatted", []))
                tier.check_ids(formatted)
                for b, f in zip(formatted, t.get("formats", []), strict=True):
                    tier.fmt_c.py[b] = _format_code(tier, str(f))
                st.tiers[name] = tier
            for s in snap["seqs"]:
                sid = s["seq"]
                if not isinstance(sid, str):
                    raise ProtocolError(f"snapshot sequence id {sid!r} is not a string")
                table = unpack_ids(s["block_table"])
                st.seqs[sid] = SeqState(
                    seq_id=sid, status=s["status"], tier=s["tier"],
                    block_table=list(table), num_tokens=int(s["num_tokens"]),
                    prompt_tokens=int(s.get("prompt_tokens", 0)),
                    priority=int(s.get("priority", 0)), parent=s.get("parent"),
                    preemptions=int(s.get("preemptions", 0)),
                    hit_tokens=int(s.get("hit_tokens", 0)), owner_id=seq_owner_id(sid),
                    group_tables={int(g): unpack_ids(t)
                                  for g, t in (s.get("group_tables") or {}).items()},
                )
            st.kind_counts = dict(snap.get("kind_counts") or {})
            st._assign_owners()
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            if isinstance(e, ProtocolError):
                raise
            raise ProtocolError(f"malformed snapshot: {e!r}") from e
        return st

    def resolve_owners(self, tier: str) -> None:
        """Give every ``ORPHAN`` block of ``tier`` a holder (one pass over the tables;
        free when there are none). Changes only the display-only owner column."""
        t = self.tiers[tier]
        own = t.owner_c.np
        orphan = own == ORPHAN
        if not orphan.any():
            return
        seqs = [s for s in self.seqs.values() if s.tier == tier and s.block_table]
        blocks = np.fromiter((b for s in seqs for b in s.block_table), dtype=np.int64)
        ids = np.repeat(np.array([s.owner_id for s in seqs], dtype=np.int64),
                        [len(s.block_table) for s in seqs])
        m = orphan[blocks]
        own[blocks[m][::-1]] = ids[m][::-1]
        own[own == ORPHAN] = -1  # held by nobody after all (cannot happen in a valid state)

    def _assign_owners(self) -> None:
        """Owners from the block tables: the first holder in sequence order wins."""
        for name, t in self.tiers.items():
            seqs = [s for s in self.seqs.values() if s.tier == name and s.block_table]
            if not seqs:
                continue
            blocks = np.fromiter((b for s in seqs for b in s.block_table), dtype=np.int64)
            if blocks.size and (blocks.min() < 0 or blocks.max() >= t.num_blocks):
                raise ProtocolError(f"snapshot tier {name}: a block table is out of range")
            ids = np.repeat(np.array([s.owner_id for s in seqs], dtype=np.int64),
                            [len(s.block_table) for s in seqs])
            t.owner_c.np[blocks[::-1]] = ids[::-1]

    @classmethod
    def from_canonical(cls, canon: dict[str, Any]) -> KVState:
        """A KVState from ``canonical()``/``kv_state()`` form (what canonical() leaves out,
        such as priorities, parents and counters, starts at its defaults)."""
        tiers = {}
        for name, t in canon["tiers"].items():
            hashed = [b for b, h in enumerate(t["hash"]) if h is not None]
            fmts = t.get("block_formats") or {}
            tiers[name] = {"num_blocks": t["num_blocks"], "block_size": t["block_size"],
                           "format": t["format"], "ref": t["ref"], "hashed": hashed,
                           "hashes": [t["hash"][b] for b in hashed],
                           "formatted": [int(b) for b in fmts], "formats": list(fmts.values())}
        snap = {"v": S.PROTOCOL_VERSION, "step": -1, "tiers": tiers,
                "seqs": [{"seq": sid, **s} for sid, s in canon["seqs"].items()]}
        return cls.from_snapshot(snap)

    def clone(self, reuse: KVState | None = None) -> KVState:
        """An independent copy: arrays, dicts and block tables are copied, not shared.

        ``reuse``: the previous frame, given up by the caller (the live inspector's last
        drawn frame): the new one is built from its parts, and ``reuse`` must not be read
        afterwards. Tiers still at the version they were cloned at are shared; when
        ``reuse`` is this state's latest clone, a changed tier is brought up to date in
        place (only the blocks changed since are copied: a 4M-block tier costs what
        changed, not 4M), and its sequence dict is taken over and patched (untouched
        sequences shared). Without ``reuse``: a full, independent copy."""
        st = KVState()
        latest = reuse is not None and reuse._clone_of == (id(self), self._clones)
        for n, t in self.tiers.items():
            old = reuse.tiers.get(n) if reuse is not None else None
            if old is not None and old._source == (id(t), t.version):
                st.tiers[n] = old
            elif (latest and old is not None and t._dirty is not None
                    and old._source is not None and old._source[0] == id(t)):
                old.refresh_from(t)
                st.tiers[n] = old
            else:
                st.tiers[n] = t.clone()
            t._dirty, t._dirty_n = [], 0
        self._clones += 1
        if latest and self._dirty_seqs is not None:
            # take over the previous frame's dict and patch it: O(changed), not O(seqs)
            # (a sequence finished and re-added under the same id keeps its old place).
            # Not a copy: a fresh 50k-entry dict a frame costs its copy and a young-
            # generation collection that walks every entry (~2.5 + 4 ms at 50k sequences)
            st.seqs = seqs = reuse.seqs
            added = set()
            for sid in self._dirty_seqs:
                s = self.seqs.get(sid)
                if s is None:
                    seqs.pop(sid, None)
                elif sid in seqs:
                    seqs[sid] = _copy_seq(s)
                else:
                    added.add(sid)
            # new sequences in this state's order (the tail of its dict holds them)
            for sid in _newest(self.seqs, added):
                seqs[sid] = _copy_seq(self.seqs[sid])
        else:
            st.seqs = {sid: _copy_seq(s) for sid, s in self.seqs.items()}
        self._dirty_seqs = set()
        st._clone_of = (id(self), self._clones)
        st.step, st.time, st.stats = self.step, self.time, self.stats
        st.kind_counts, st.unknown_kinds = dict(self.kind_counts), self.unknown_kinds
        return st

    # ----------------------------------------------------------------- apply
    def apply(self, batch: dict[str, Any]) -> None:
        """Apply one step's batch. Atomic: on ProtocolError the state is unchanged.

        Accepts protocol 1 (id lists as lists of ints), 2 (id lists packed) and a batch
        holding ``"columns"`` (an ``engine.events.columns.StepColumns``, the columnar
        form, protocol 3 on the wire): that takes the columnar fast path
        (``engine.events.state_columns``), which equals this per-event one."""
        if not isinstance(batch, dict) or batch.get("v") not in S.READABLE_VERSIONS:
            raise ProtocolError(
                f"batch protocol version {getattr(batch, 'get', lambda _k: None)('v')!r}, "
                f"expected one of {S.READABLE_VERSIONS}"
            )
        cols = batch.get("columns")
        if cols is not None:
            from kvscope.engine.events.state_columns import apply_columns  # its friend module
            apply_columns(self, batch, cols)
            return
        events = batch.get("events", [])
        if not isinstance(events, list):
            raise ProtocolError("batch 'events' is not a list")
        self._begin_step(batch)
        try:
            self._apply_events(events)
        except ProtocolError:
            self._rollback()
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as e:
            self._rollback()
            raise ProtocolError(f"malformed event: {e!r}") from e
        self._commit(batch)

    def _begin_step(self, batch: dict[str, Any]) -> None:
        step = batch.get("step", self.step + 1)
        self._cur_step = step if type(step) is int and -(1 << 31) <= step < (1 << 31) else -1
        self._begin()

    def _apply_events(self, events: list[Any]) -> None:
        """The reference: each event's handler, in order (inside a _begin/_commit)."""
        handlers, counts = _HANDLERS, self.kind_counts
        for ev in events:
            kind = ev["kind"]
            handler = handlers.get(kind)
            if handler is None:
                self.unknown_kinds += 1
                continue
            handler(self, ev)
            counts[kind] = counts.get(kind, 0) + 1

    def _commit(self, batch: dict[str, Any]) -> None:
        self._undo = None
        dirty = self._dirty_seqs
        if dirty is not None:
            dirty |= self._touched
            dirty |= self._batch_dirty
            if len(dirty) > len(self.seqs) + _DIRTY_SLACK:
                self._dirty_seqs = None
        self.step = int(batch.get("step", self.step + 1))
        self.time = float(batch.get("time", self.time))
        stats = batch.get("stats")
        if isinstance(stats, dict):
            self.stats = stats

    # ------------------------------------------------------------- undo log
    # Every mutation inside apply() first logs what it overwrites: _save a column's old
    # values at the ids about to change (or the whole column, once per batch, for small
    # tiers), _seq a sequence's fields the first time a batch touches it, _save_item a
    # tier or sequence about to appear or disappear. _rollback replays the log backwards,
    # restoring objects in place, so entries logged in any order compose.
    def _begin(self) -> None:
        self._undo = []
        self._idx_key = self._idx_val = None
        self._touched: set[str] = set()
        self._batch_dirty: set[str] = set()  # also changed by this batch (for clone)
        self._seq_order: list[str] | None = None  # saved before the first seq_finish
        self._saved_counts = (dict(self.kind_counts), self.unknown_kinds)

    def _save(self, col: Column, ids: list[int]) -> None:
        """Log ``col``'s values at ``ids`` (what this batch is about to overwrite)."""
        if len(ids) <= _SMALL:
            py = col.py
            self._undo.append((_COL, col, ids, [py[b] for b in ids]))
        else:
            idx = self._idx(ids)
            self._undo.append((_COL, col, idx, col.np[idx]))  # fancy indexing copies

    def _save3(self, c0: Column, c1: Column, c2: Column, ids: list[int]) -> None:
        """``_save`` of three columns in one undo entry (every block change touches three:
        ref/owner/last change, or hash presence/value/last change)."""
        if len(ids) == 1:  # most block events: no list comprehension (a frame) for one
            p0, p1, p2 = c0.py, c1.py, c2.py
            b = ids[0]
            self._undo.append((_COL3, (p0, p1, p2), ids, [(p0[b], p1[b], p2[b])]))
        elif len(ids) <= _SMALL:
            p0, p1, p2 = c0.py, c1.py, c2.py
            self._undo.append((_COL3, (p0, p1, p2), ids, [(p0[b], p1[b], p2[b]) for b in ids]))
        else:
            for col in (c0, c1, c2):
                self._save(col, ids)

    def _save_columns(self, t: TierState, idx: np.ndarray) -> None:
        """Log every column of ``t`` at ``idx`` (the columnar apply's sub-runs)."""
        for col in t.columns():
            self._undo.append((_COL, col, idx, col.np[idx]))

    def _save_tokens(self, objs: list[SeqState]) -> None:
        """Log the token counts of ``objs`` (one entry for a whole seq_tokens event)."""
        self._undo.append((_TOKENS, objs, None, [s.num_tokens for s in objs]))

    def _idx(self, ids: list[int]) -> np.ndarray:
        """``ids`` as an int64 array, converted once per id list (large events only)."""
        if self._idx_key is not ids:
            self._idx_key, self._idx_val = ids, np.asarray(ids, dtype=np.int64)
        return self._idx_val

    def _save_item(self, d: dict, key: Any) -> None:
        self._undo.append((_ITEM, d, key, d.get(key, _MISSING)))

    def _save_big_hashes(self, t: TierState) -> None:
        self._undo.append((_BIG, t, None, dict(t.big_hashes)))

    def _rollback(self) -> None:
        undo, self._undo = self._undo or [], None
        for op, target, key, old in reversed(undo):
            if op is _COL:
                if isinstance(key, np.ndarray):
                    target.np[key] = old  # repeated ids saved the same old value
                else:
                    py = target.py
                    for b, v in zip(key, old, strict=True):
                        py[b] = v
            elif op is _COL3:
                p0, p1, p2 = target
                for b, (v0, v1, v2) in zip(key, old, strict=True):
                    p0[b], p1[b], p2[b] = v0, v1, v2
            elif op is _ITEM:
                if old is _MISSING:
                    target.pop(key, None)
                else:
                    target[key] = old
            elif op is _SEQ:
                fields, table_len = old
                target.__dict__.update(fields)
                del fields["block_table"][table_len:]  # undo in-place appends
            elif op is _ENTRY:
                target[key] = old
            elif op is _TOKENS:
                for seq, n in zip(target, old, strict=True):
                    seq.num_tokens = n
            elif op is _BIG:
                target.big_hashes = old
            else:  # _FORMATS
                target.format_names[:] = old
        if self._seq_order is not None:  # re-inserted sequences go back to their place
            self.seqs = {sid: self.seqs[sid] for sid in self._seq_order if sid in self.seqs}
        self.kind_counts, self.unknown_kinds = self._saved_counts

    def _tier(self, name: Any) -> TierState:
        t = self.tiers.get(name)
        if t is None:
            raise ProtocolError(f"unknown tier {name!r}")
        return t

    def _seq(self, sid: Any) -> SeqState:
        """The sequence, saved to the undo log the first time this batch touches it."""
        s = self.seqs.get(sid) if isinstance(sid, str) else None
        if s is None:
            raise ProtocolError(f"unknown sequence {sid!r}")
        if sid not in self._touched:
            self._touched.add(sid)
            # the table object and its length: handlers only append to a table in place
            # or replace it with a new list (cow's in-place writes log _ENTRY), so this
            # restores it without copying it
            self._undo.append((_SEQ, s, None, (s.__dict__.copy(), len(s.block_table))))
        return s

    # ------------------------------------------------------- column helpers
    # Each takes ids already range-checked. Small id lists loop over array.array (cheap
    # scalar access); large ones use numpy fancy indexing on the same memory.
    def _take(self, t: TierState, ids: list[int], owner: int) -> None:
        """ids go from ref 0 to ref 1, owned by ``owner``, touched now."""
        t.mark(ids)
        self._save3(t.ref_c, t.owner_c, t.touched_c, ids)
        step = self._cur_step
        if len(ids) <= _SMALL:
            ref, own, tch = t.ref_c.py, t.owner_c.py, t.touched_c.py
            for b in ids:
                ref[b] = 1
                own[b] = owner
                tch[b] = step
        else:
            idx = self._idx(ids)
            t.ref_c.np[idx] = 1
            t.owner_c.np[idx] = owner
            t.touched_c.np[idx] = step

    def _hold(self, t: TierState, ids: list[int], owner: int) -> None:
        """ref += 1 per entry; blocks that were unheld become ``owner``'s."""
        t.mark(ids)
        self._save3(t.ref_c, t.owner_c, t.touched_c, ids)
        step = self._cur_step
        if len(ids) <= _SMALL:
            ref, own, tch = t.ref_c.py, t.owner_c.py, t.touched_c.py
            for b in ids:
                r = ref[b] + 1
                ref[b] = r
                if r == 1:
                    own[b] = owner
                tch[b] = step
        else:
            idx = self._idx(ids)
            ref = t.ref_c.np
            was_free = ref[idx] == 0
            np.add.at(ref, idx, 1)
            t.owner_c.np[idx[was_free]] = owner
            t.touched_c.np[idx] = step

    def _release(self, t: TierState, ids: list[int], owner: int) -> None:
        """ref -= 1 per entry; ``owner``'s blocks lose their owner (see module doc)."""
        t.mark(ids)
        self._save3(t.ref_c, t.owner_c, t.touched_c, ids)
        step = self._cur_step
        if len(ids) <= _SMALL:
            ref, own, tch = t.ref_c.py, t.owner_c.py, t.touched_c.py
            for b in ids:
                r = ref[b] - 1
                ref[b] = r
                if r == 0:
                    own[b] = -1
                elif own[b] == owner:
                    own[b] = ORPHAN
                tch[b] = step
        else:
            idx = self._idx(ids)
            ref, own = t.ref_c.np, t.owner_c.np
            np.add.at(ref, idx, -1)
            left = ref[idx]
            own[idx[(left > 0) & (own[idx] == owner)]] = ORPHAN
            own[idx[left == 0]] = -1
            t.touched_c.np[idx] = step
        self._drop_formats(t, ids)

    def _drop_formats(self, t: TierState, ids: list[int]) -> None:
        """Blocks that became free (ref 0, no hash) lose their page, hence a demoted
        format: they revert to the tier's (format code 0)."""
        if len(t.format_names) < 2:  # no block of this tier was ever quantized
            return
        ref, hashed, fc = t.ref_c.py, t.hashed_c.py, t.fmt_c.py
        freed = [b for b in ids if fc[b] and not ref[b] and not hashed[b]]
        if freed:
            self._save(t.fmt_c, freed)
            for b in freed:
                fc[b] = 0

    def _set_hashes(self, t: TierState, ids: list[int], hashes: list[Any]) -> None:
        t.mark(ids)
        self._save3(t.hashed_c, t.hash_c, t.touched_c, ids)
        step = self._cur_step
        if not t.big_hashes:  # the common case: every hash fits int64
            try:
                if len(ids) <= _SMALL:
                    hv, hs, tch = t.hash_c.py, t.hashed_c.py, t.touched_c.py
                    for b, h in zip(ids, hashes, strict=True):
                        hv[b] = h  # array('q') raises OverflowError beyond int64
                        hs[b] = 1
                        tch[b] = step
                else:
                    idx = self._idx(ids)
                    t.hash_c.np[idx] = np.array(hashes, dtype=np.int64)
                    t.hashed_c.np[idx] = 1
                    t.touched_c.np[idx] = step
                return
            except OverflowError:
                pass
        self._save_big_hashes(t)
        tch = t.touched_c.py
        for b, h in zip(ids, hashes, strict=True):
            t.set_hash(b, h)
            tch[b] = step

    def _free_blocks(self, t: TierState, ids: list[int], what: str) -> None:
        """Raise unless every id is free (ref 0, no hash) and none repeats."""
        if len(ids) > _SMALL:
            idx = self._idx(ids)
            bad = np.flatnonzero(t.ref_c.np[idx] | t.hashed_c.np[idx])
            if bad.size:
                raise ProtocolError(f"{what}: {t.name} block {ids[bad[0]]} is not free")
        else:
            ref, hashed = t.ref_c.py, t.hashed_c.py
            for b in ids:
                if ref[b] or hashed[b]:
                    raise ProtocolError(f"{what}: {t.name} block {b} is not free")
        if len(ids) > 1 and len(set(ids)) != len(ids):
            raise ProtocolError(f"{what}: duplicate block ids")

    # One method per kind. Each validates before it mutates what it touches.
    def _tier_init(self, ev: dict[str, Any]) -> None:
        name = ev["tier"]
        if name not in S.TIERS:
            raise ProtocolError(f"unknown tier {name!r}")
        if "group" in ev:
            name = S.group_pool(name, self._group_id(ev))
        n, bs = int(ev["num_blocks"]), int(ev["block_size"])
        if n < 0 or bs < 1 or n > MAX_TIER_BLOCKS or bs >= 1 << 31:
            raise ProtocolError(f"tier {name}: bad size {n} blocks x {bs} tokens (a mirror "
                                f"holds at most {MAX_TIER_BLOCKS} blocks a tier)")
        self._save_item(self.tiers, name)
        self.tiers[name] = TierState(name, n, bs, str(ev.get("format", "auto")))

    def _seq_add(self, ev: dict[str, Any]) -> None:
        sid = ev["seq"]
        if not isinstance(sid, str) or sid in self.seqs:
            raise ProtocolError(f"seq_add: bad or duplicate sequence id {sid!r}")
        self._save_item(self.seqs, sid)
        self._batch_dirty.add(sid)
        self.seqs[sid] = SeqState(
            seq_id=sid, prompt_tokens=int(ev.get("prompt_tokens", 0)),
            priority=int(ev.get("priority", 0)), parent=ev.get("parent"),
            owner_id=seq_owner_id(sid),
        )

    def _seq_start(self, ev: dict[str, Any]) -> None:
        self._seq(ev["seq"]).status = "running"

    def _alloc(self, ev: dict[str, Any]) -> None:
        if ev.get("group"):
            return self._group_alloc(ev)
        t, s, blocks = self._tier(ev["tier"]), self._seq(ev["seq"]), unpack_ids(ev["blocks"])
        t.check_ids(blocks)
        self._require_table_tier(s, t)
        self._free_blocks(t, blocks, "alloc")
        self._take(t, blocks, s.owner_id)
        s.block_table.extend(blocks)

    def _hit(self, ev: dict[str, Any]) -> None:
        if ev.get("group"):
            return self._group_hit(ev)
        t, s, blocks = self._tier(ev["tier"]), self._seq(ev["seq"]), unpack_ids(ev["blocks"])
        t.check_ids(blocks)
        self._require_table_tier(s, t)
        hashed = t.hashed_c.py
        for b in blocks:
            if not hashed[b]:
                raise ProtocolError(f"hit: {t.name} block {b} is not cached")
        self._hold(t, blocks, s.owner_id)
        s.block_table.extend(blocks)
        s.hit_tokens += int(ev.get("tokens", 0))

    def _pool_of(self, ev: dict[str, Any]) -> TierState:
        """The pool an index event (store, evict) addresses: a tier, or a group's pool."""
        if ev.get("group"):
            return self._tier(S.group_pool(ev["tier"], self._group_id(ev)))
        return self._tier(ev["tier"])

    def _store(self, ev: dict[str, Any]) -> None:
        t, blocks, hashes = self._pool_of(ev), unpack_ids(ev["blocks"]), ev["hashes"]
        t.check_ids(blocks)
        hashes = list(map(int, hashes))
        if len(blocks) != len(hashes):
            raise ProtocolError("store: blocks and hashes differ in length")
        self._set_hashes(t, blocks, hashes)

    def _evict(self, ev: dict[str, Any]) -> None:
        t, blocks = self._pool_of(ev), unpack_ids(ev["blocks"])
        t.check_ids(blocks)
        ref, hashed = t.ref_c.py, t.hashed_c.py
        if len(blocks) > _SMALL:
            idx = self._idx(blocks)
            bad = np.flatnonzero((t.ref_c.np[idx] != 0) | (t.hashed_c.np[idx] == 0))
            if bad.size:
                raise ProtocolError(f"evict: {t.name} block {blocks[bad[0]]} is not a cached "
                                    "free block")
        else:
            for b in blocks:
                if ref[b] or not hashed[b]:
                    raise ProtocolError(f"evict: {t.name} block {b} is not a cached free block")
        t.mark(blocks)
        self._save3(t.hashed_c, t.hash_c, t.touched_c, blocks)
        if t.big_hashes:
            self._save_big_hashes(t)
            for b in blocks:
                t.big_hashes.pop(b, None)
        if len(blocks) > _SMALL:
            idx = self._idx(blocks)
            t.hashed_c.np[idx] = 0
            t.hash_c.np[idx] = 0
            t.touched_c.np[idx] = self._cur_step
            self._drop_formats(t, blocks)
            return
        hv, tch, step = t.hash_c.py, t.touched_c.py, self._cur_step
        for b in blocks:
            hashed[b] = 0
            hv[b] = 0
            tch[b] = step
        self._drop_formats(t, blocks)

    def _free(self, ev: dict[str, Any]) -> None:
        if ev.get("group"):
            return self._group_free(ev)
        t, s, blocks = self._tier(ev["tier"]), self._seq(ev["seq"]), unpack_ids(ev["blocks"])
        if s.tier != t.name or blocks != s.block_table:
            raise ProtocolError(f"free: {s.seq_id} does not hold exactly {t.name} {blocks}")
        self._release(t, blocks, s.owner_id)
        s.block_table = []
        s.num_tokens = 0

    def _fork(self, ev: dict[str, Any]) -> None:
        if ev.get("group"):
            return self._group_fork(ev)
        t, s, parent = self._tier(ev["tier"]), self._seq(ev["seq"]), self._seq(ev["parent"])
        blocks = unpack_ids(ev["blocks"])
        if parent.tier != t.name or blocks != parent.block_table or s.block_table:
            raise ProtocolError(f"fork: {s.seq_id} cannot share {parent.seq_id}'s blocks")
        s.tier = t.name
        self._hold(t, blocks, s.owner_id)
        s.block_table = list(blocks)
        s.num_tokens = parent.num_tokens

    def _cow(self, ev: dict[str, Any]) -> None:
        if ev.get("group"):
            return self._group_cow(ev)
        t, s = self._tier(ev["tier"]), self._seq(ev["seq"])
        logical, src, dst = ev["logical"], unpack_ids(ev["src"]), unpack_ids(ev["dst"])
        logical = unpack_ids(logical)
        t.check_ids(src)
        t.check_ids(dst)
        if not len(logical) == len(src) == len(dst):
            raise ProtocolError("cow: logical, src and dst differ in length")
        for i, a, b in zip(logical, src, dst, strict=True):
            if not 0 <= i < len(s.block_table) or s.block_table[i] != a:
                raise ProtocolError(f"cow: {s.seq_id}[{i}] is not block {a}")
            self._free_blocks(t, [b], "cow")  # checked per pair: dst may repeat a src
            self._release(t, [a], s.owner_id)
            self._take(t, [b], s.owner_id)
            self._undo.append((_ENTRY, s.block_table, i, a))
            s.block_table[i] = b

    # KV cache groups other than 0 (hybrid cache): the same meanings over the group's own
    # pool and the sequence's table in that group
    @staticmethod
    def _group_id(ev: dict[str, Any]) -> int:
        g = ev["group"]
        if type(g) is not int or not 0 <= g < 64:
            raise ProtocolError(f"{ev.get('kind')}: bad cache group {g!r}")
        return g

    def _group_of(self, ev: dict[str, Any]) -> tuple[TierState, int, SeqState, list[int]]:
        g = self._group_id(ev)
        t = self._tier(S.group_pool(ev["tier"], g))
        s, blocks = self._seq(ev["seq"]), unpack_ids(ev["blocks"])
        t.check_ids(blocks)
        return t, g, s, blocks

    def _group_alloc(self, ev: dict[str, Any]) -> None:
        t, g, s, blocks = self._group_of(ev)
        self._free_blocks(t, blocks, "alloc")
        self._take(t, blocks, s.owner_id)
        s.group_tables = {**s.group_tables, g: s.group_tables.get(g, []) + blocks}

    def _group_hit(self, ev: dict[str, Any]) -> None:
        t, g, s, blocks = self._group_of(ev)
        hashed = t.hashed_c.py
        for b in blocks:
            if not hashed[b]:
                raise ProtocolError(f"hit: {t.name} block {b} is not cached")
        self._hold(t, blocks, s.owner_id)
        s.group_tables = {**s.group_tables, g: s.group_tables.get(g, []) + blocks}

    def _group_free(self, ev: dict[str, Any]) -> None:
        t, g, s, blocks = self._group_of(ev)
        if blocks != s.group_tables.get(g, []):
            raise ProtocolError(f"free: {s.seq_id} does not hold exactly {t.name} {blocks}")
        self._release(t, blocks, s.owner_id)
        s.group_tables = {k: v for k, v in s.group_tables.items() if k != g}

    def _release_ev(self, ev: dict[str, Any]) -> None:
        t, g, s, blocks = self._group_of(ev)
        table = s.group_tables.get(g, [])
        if not g or table[:len(blocks)] != blocks:
            raise ProtocolError(f"release: {blocks} are not the oldest {t.name} blocks of "
                                f"{s.seq_id}")
        self._release(t, blocks, s.owner_id)
        rest = table[len(blocks):]
        s.group_tables = {**{k: v for k, v in s.group_tables.items() if k != g},
                          **({g: rest} if rest else {})}

    def _group_fork(self, ev: dict[str, Any]) -> None:
        t, g, s, blocks = self._group_of(ev)
        parent = self._seq(ev["parent"])
        if blocks != parent.group_tables.get(g, []) or s.group_tables.get(g):
            raise ProtocolError(f"fork: {s.seq_id} cannot share {parent.seq_id}'s {t.name} "
                                "blocks")
        self._hold(t, blocks, s.owner_id)
        s.group_tables = {**s.group_tables, g: list(blocks)}

    def _group_cow(self, ev: dict[str, Any]) -> None:
        g = self._group_id(ev)
        t, s = self._tier(S.group_pool(ev["tier"], g)), self._seq(ev["seq"])
        logical, src, dst = unpack_ids(ev["logical"]), unpack_ids(ev["src"]), unpack_ids(ev["dst"])
        t.check_ids(src)
        t.check_ids(dst)
        if not len(logical) == len(src) == len(dst):
            raise ProtocolError("cow: logical, src and dst differ in length")
        table = list(s.group_tables.get(g, []))
        for i, a, b in zip(logical, src, dst, strict=True):
            if not 0 <= i < len(table) or table[i] != a:
                raise ProtocolError(f"cow: {s.seq_id}[{i}] of {t.name} is not block {a}")
            self._free_blocks(t, [b], "cow")
            self._release(t, [a], s.owner_id)
            self._take(t, [b], s.owner_id)
            table[i] = b
        s.group_tables = {**s.group_tables, g: table}

    def _seq_tokens(self, ev: dict[str, Any]) -> None:
        seqs, counts = ev["seqs"], list(map(int, ev["num_tokens"]))
        if type(seqs) is not list or len(seqs) != len(counts):
            raise ProtocolError("seq_tokens: seqs and num_tokens differ in length")
        # the hot path of every decode step: one undo entry for all, not a copy per seq
        table = self.seqs
        try:
            objs = list(map(table.__getitem__, seqs))
            self._batch_dirty.update(seqs)
        except (KeyError, TypeError):
            missing = next(sid for sid in seqs if not isinstance(sid, str) or sid not in table)
            raise ProtocolError(f"unknown sequence {missing!r}") from None
        self._undo.append((_TOKENS, objs, None, [s.num_tokens for s in objs]))
        for s, n in zip(objs, counts, strict=True):
            s.num_tokens = n

    def _seq_preempt(self, ev: dict[str, Any]) -> None:
        s, mode = self._seq(ev["seq"]), ev["mode"]
        if mode not in S.PREEMPT_MODES:
            raise ProtocolError(f"seq_preempt: unknown mode {mode!r}")
        s.status = "swapped" if mode == "swap" else "waiting"
        s.preemptions += 1

    def _seq_resume(self, ev: dict[str, Any]) -> None:
        self._seq(ev["seq"]).status = "running"

    def _seq_finish(self, ev: dict[str, Any]) -> None:
        s = self._seq(ev["seq"])
        if s.block_table:
            raise ProtocolError(f"seq_finish: {s.seq_id} still holds blocks (free it first)")
        if self._seq_order is None:
            self._seq_order = list(self.seqs)
        self._save_item(self.seqs, s.seq_id)
        del self.seqs[s.seq_id]

    def _move(self, ev: dict[str, Any], src_tier: str, dst_tier: str) -> None:
        s = self._seq(ev["seq"])
        a, b = self._tier(src_tier), self._tier(dst_tier)
        src, dst = unpack_ids(ev["src"]), unpack_ids(ev["dst"])
        a.check_ids(src)
        b.check_ids(dst)
        if s.tier != src_tier or src != s.block_table or len(dst) != len(src):
            raise ProtocolError(f"{ev['kind']}: {s.seq_id} does not hold {src_tier} {src}")
        self._release(a, src, s.owner_id)
        self._hold(b, dst, s.owner_id)
        s.tier, s.block_table = dst_tier, list(dst)

    def _group_move(self, ev: dict[str, Any], src_tier: str, dst_tier: str) -> None:
        """swap_out/swap_in of a group other than 0: the sequence's table of that group
        moves between the group's pools of the two tiers."""
        g = self._group_id(ev)
        s = self._seq(ev["seq"])
        a, b = self._tier(S.group_pool(src_tier, g)), self._tier(S.group_pool(dst_tier, g))
        src, dst = unpack_ids(ev["src"]), unpack_ids(ev["dst"])
        a.check_ids(src)
        b.check_ids(dst)
        if src != s.group_tables.get(g, []) or len(dst) != len(src):
            raise ProtocolError(f"{ev['kind']}: {s.seq_id} does not hold {a.name} {src}")
        self._release(a, src, s.owner_id)
        self._hold(b, dst, s.owner_id)
        s.group_tables = {**{k: v for k, v in s.group_tables.items() if k != g},
                          **({g: list(dst)} if dst else {})}

    def _swap_out(self, ev: dict[str, Any]) -> None:
        if ev.get("group"):
            return self._group_move(ev, "gpu", "cpu")
        self._move(ev, "gpu", "cpu")

    def _swap_in(self, ev: dict[str, Any]) -> None:
        if ev.get("group"):
            return self._group_move(ev, "cpu", "gpu")
        self._move(ev, "cpu", "gpu")

    def _offload(self, ev: dict[str, Any]) -> None:
        host = self._tier(S.group_pool("cpu", self._group_id(ev)) if ev.get("group")
                          else "cpu")
        dst, hashes = unpack_ids(ev["dst"]), [int(h) for h in ev["hashes"]]
        host.check_ids(dst)
        if len(dst) != len(hashes):
            raise ProtocolError("offload: dst and hashes differ in length")
        ref = host.ref_c.py
        for b in dst:
            if ref[b]:
                raise ProtocolError(f"offload: host block {b} is in use")
        self._set_hashes(host, dst, hashes)

    def _host_hit(self, ev: dict[str, Any]) -> None:
        host, dev, s = self._tier("cpu"), self._tier("gpu"), self._seq(ev["seq"])
        src, dst = unpack_ids(ev["src"]), unpack_ids(ev["dst"])
        host.check_ids(src)
        dev.check_ids(dst)
        self._require_table_tier(s, dev)
        if len(src) != len(dst):
            raise ProtocolError("host_hit: src and dst differ in length")
        hashed = host.hashed_c.py
        for a in src:
            if not hashed[a]:
                raise ProtocolError(f"host_hit: host block {a} is not cached")
        self._free_blocks(dev, dst, "host_hit")
        self._take(dev, dst, s.owner_id)
        self._set_hashes(dev, dst, [host.hash_value(a) for a in src])
        s.block_table.extend(dst)
        s.hit_tokens += int(ev.get("tokens", 0))

    def _disk_store(self, ev: dict[str, Any]) -> None:
        host, disk = self._tier("cpu"), self._tier("disk")
        src, dst = unpack_ids(ev["src"]), unpack_ids(ev["dst"])
        hashes = [int(h) for h in ev["hashes"]]
        host.check_ids(src)
        disk.check_ids(dst)
        if not len(src) == len(dst) == len(hashes):
            raise ProtocolError("disk_store: src, dst and hashes differ in length")
        self._free_blocks(disk, dst, "disk_store")
        self._set_hashes(disk, dst, hashes)

    def _cached_on_disk(self, ev: dict[str, Any], what: str) -> tuple[TierState, list[int]]:
        disk, src = self._tier("disk"), unpack_ids(ev["src"])
        disk.check_ids(src)
        hashed = disk.hashed_c.py
        for b in src:
            if not hashed[b]:
                raise ProtocolError(f"{what}: disk block {b} is not cached")
        return disk, src

    def _prefetch_ev(self, ev: dict[str, Any]) -> None:
        self._seq(ev["seq"])
        self._cached_on_disk(ev, "prefetch")  # nothing changes until they arrive

    def _disk_load(self, ev: dict[str, Any]) -> None:
        # the sequence may have finished meanwhile: what arrives still becomes host cache
        disk, src = self._cached_on_disk(ev, "disk_load")
        host, dst = self._tier("cpu"), unpack_ids(ev["dst"])
        host.check_ids(dst)
        if len(src) != len(dst):
            raise ProtocolError("disk_load: src and dst differ in length")
        self._free_blocks(host, dst, "disk_load")
        self._set_hashes(host, dst, [disk.hash_value(b) for b in src])

    def _quantize(self, ev: dict[str, Any]) -> None:
        """Demotion: the blocks' page format changes in place (refs, hashes and block
        tables are unchanged). Only blocks holding K/V (in use or cached) can change; a
        block that becomes free reverts to the tier's format (``_drop_formats``)."""
        t, blocks, fmt = self._tier(ev["tier"]), unpack_ids(ev["blocks"]), ev["format"]
        if not isinstance(fmt, str) or not fmt:
            raise ProtocolError(f"quantize: format {fmt!r} is not a name")
        t.check_ids(blocks)
        ref, hashed = t.ref_c.py, t.hashed_c.py
        for b in blocks:  # only a page holding K/V (in use or cached) has a format
            if not ref[b] and not hashed[b]:
                raise ProtocolError(f"quantize: {t.name} block {b} is free")
        if fmt not in t.format_names:
            self._undo.append((_FORMATS, t, None, list(t.format_names)))
        code = _format_code(t, fmt)
        t.mark(blocks)
        for col in (t.fmt_c, t.touched_c):
            self._save(col, blocks)
        if len(blocks) <= _SMALL:
            fc, tch, step = t.fmt_c.py, t.touched_c.py, self._cur_step
            for b in blocks:
                fc[b] = code
                tch[b] = step
        else:
            idx = self._idx(blocks)
            t.fmt_c.np[idx] = code
            t.touched_c.np[idx] = self._cur_step

    def _require_table_tier(self, s: SeqState, t: TierState) -> None:
        if s.block_table and s.tier != t.name:
            raise ProtocolError(f"{s.seq_id}'s table is in tier {s.tier}, not {t.name}")
        s.tier = t.name


def _format_code(t: TierState, fmt: str) -> int:
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


_MISSING = object()  # undo-log marker: "this key did not exist"
# undo entries
_COL, _COL3, _ITEM, _SEQ, _TOKENS, _BIG, _FORMATS, _ENTRY = (
    "col", "col3", "item", "seq", "tokens", "big", "formats", "entry")


def _newest(seqs: dict[str, SeqState], ids: set[str]) -> list[str]:
    """``ids`` (keys of ``seqs``) in ``seqs``' order, reading only its tail back to the
    oldest of them: O(entries added since), not O(seqs)."""
    out: list[str] = []
    if ids:
        for sid in reversed(seqs):
            if sid in ids:
                out.append(sid)
                if len(out) == len(ids):
                    break
    return out[::-1]


def _copy_seq(s: SeqState) -> SeqState:
    c = SeqState.__new__(SeqState)
    c.__dict__.update(s.__dict__)
    c.block_table = list(s.block_table)
    return c


def _group_tables(tables: dict[int, list[int]]) -> dict[str, Any]:
    """``canonical()``'s per-sequence group tables: absent when it holds none (so every
    producer without cache groups compares as before)."""
    held = {str(g): list(t) for g, t in sorted(tables.items()) if t}
    return {"group_tables": held} if held else {}


_HANDLERS = {
    S.TIER_INIT: KVState._tier_init,
    S.RELEASE: KVState._release_ev,
    S.SEQ_ADD: KVState._seq_add,
    S.SEQ_START: KVState._seq_start,
    S.ALLOC: KVState._alloc,
    S.HIT: KVState._hit,
    S.STORE: KVState._store,
    S.EVICT: KVState._evict,
    S.FREE: KVState._free,
    S.FORK: KVState._fork,
    S.COW: KVState._cow,
    S.SEQ_TOKENS: KVState._seq_tokens,
    S.SEQ_PREEMPT: KVState._seq_preempt,
    S.SEQ_RESUME: KVState._seq_resume,
    S.SEQ_FINISH: KVState._seq_finish,
    S.SWAP_OUT: KVState._swap_out,
    S.SWAP_IN: KVState._swap_in,
    S.OFFLOAD: KVState._offload,
    S.HOST_HIT: KVState._host_hit,
    S.QUANTIZE: KVState._quantize,
    S.DISK_STORE: KVState._disk_store,
    S.PREFETCH: KVState._prefetch_ev,
    S.DISK_LOAD: KVState._disk_load,
}
