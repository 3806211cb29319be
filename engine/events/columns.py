"""One step's events as typed columns: the columnar form of a batch.

Torch-free. The hot kinds (the 1-4 block operations that are most of a step's events)
travel as little-endian arrays; every other event (and any hot event that does not fit
the columns: a foreign hash beyond int64, a ``store`` with vLLM detail, a malformed one)
travels as its plain map, in its place in the step's order.

Columns, one entry per event of the step, in the step's order:

    kind   uint8   HOT_KINDS index + 1, or OTHER (0): the next map of ``others``
    tier   uint8   index into schema.TIERS (block kinds)
    seq    int32   index into ``names`` (alloc, hit, free), else -1
    arg    int64   hit: tokens; evict: index into ``causes`` or -1; else 0
    off    int32   n + 1 offsets into ``ids``: event i's list is ids[off[i]:off[i+1]]

and the variable-length lists, concatenated in event order:

    ids    int32   block ids (alloc, hit, free, store, evict); seq_tokens: ``names`` indices
    vals   int64   one per id of the store (its hashes) and seq_tokens (token counts)
                   events, in order; nothing for the other kinds

A ``StepColumns`` means exactly what ``to_events()`` gives (``KVState.apply`` is the one
meaning); ``KVState.apply`` of a batch holding ``"columns"`` takes the columnar fast path,
proven equal by tests/events/test_columns.py. ``from_events(to_events())`` is the
identity on columns, and ``to_events(from_events(evs))`` applies exactly like ``evs``
(an absent hit ``tokens`` becomes 0, its documented default).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvscope.engine.events import schema as S
from kvscope.engine.events.schema import ProtocolError

OTHER = 0
HOT_KINDS = (S.ALLOC, S.HIT, S.FREE, S.STORE, S.EVICT, S.SEQ_TOKENS)
ALLOC, HIT, FREE, STORE, EVICT, SEQ_TOKENS = range(1, len(HOT_KINDS) + 1)
KIND_CODE = {k: i + 1 for i, k in enumerate(HOT_KINDS)}
SEQ_KINDS = (ALLOC, HIT, FREE)  # the kinds whose ``seq`` column names a sequence
VALUED = (STORE, SEQ_TOKENS)  # the kinds with one ``vals`` entry per id
TIER_CODE = {t: i for i, t in enumerate(S.TIERS)}

# the arrays and their wire dtypes (little-endian), in to_wire()'s order
DTYPES = {"kind": "<u1", "tier": "<u1", "seq": "<i4", "arg": "<i8", "off": "<i4",
          "ids": "<i4", "vals": "<i8"}
_I32 = (-(1 << 31), (1 << 31) - 1)
_I64 = (-(1 << 63), (1 << 63) - 1)
_LITTLE = sys.byteorder == "little"


@dataclass
class StepColumns:
    """One step's events as columns (see the module docstring). The arrays are numpy,
    native-endian; ``others`` holds the maps of the ``OTHER`` entries, in order."""

    kind: np.ndarray
    tier: np.ndarray
    seq: np.ndarray
    arg: np.ndarray
    off: np.ndarray
    ids: np.ndarray
    vals: np.ndarray
    names: list[str] = field(default_factory=list)
    causes: list[Any] = field(default_factory=list)
    others: list[Any] = field(default_factory=list)
    # the events these columns were built from (``from_events``), if any: the small-batch
    # path applies them as they are instead of rebuilding them (``to_events``)
    source: list[Any] | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.kind)

    # ------------------------------------------------------------- building
    @classmethod
    def from_events(cls, events: list[Any]) -> StepColumns:
        """Events (plain maps, as sinks emit them and the codec decodes them) -> columns.
        Never raises: an event the columns cannot hold exactly goes to ``others``."""
        b = _Builder()
        for ev in events:
            if not b.add(ev):
                b.other(ev)
        c = b.build()
        c.source = events if type(events) is list else None
        return c

    def to_events(self, packed: bool = False) -> list[Any]:
        """The events these columns stand for, as plain maps in order (id lists as lists
        of ints, or ``packed`` as protocol 2's packed bytes: no Python int per id; the
        source events themselves where the columns were built from them)."""
        if self.source is not None:
            return self.source
        return Rows(self).events(0, len(self.kind), packed)

    def valued(self) -> np.ndarray:
        """bool per entry: its ids have one ``vals`` entry each (store, seq_tokens)."""
        return (self.kind == STORE) | (self.kind == SEQ_TOKENS)

    # ----------------------------------------------------------------- wire
    def to_wire(self) -> dict[str, Any]:
        """The msgpack-ready form: each array packed little-endian, plus the lists."""
        out: dict[str, Any] = {name: _pack(getattr(self, name), dt)
                               for name, dt in DTYPES.items()}
        out.update(names=self.names, causes=self.causes)
        return out

    @classmethod
    def from_wire(cls, cols: Any, others: list[Any]) -> StepColumns:
        """``to_wire()``'s form (untrusted) plus the batch's ``others`` -> StepColumns,
        checked: every length, offset, code and index. Raises ProtocolError."""
        if not isinstance(cols, dict):
            raise ProtocolError("batch 'cols' is not a map")
        arrays = {}
        for name, dt in DTYPES.items():
            raw = cols.get(name)
            if not isinstance(raw, bytes):
                raise ProtocolError(f"cols field {name!r} is not packed bytes")
            size = np.dtype(dt).itemsize
            if len(raw) % size:
                raise ProtocolError(f"cols field {name!r}: {len(raw)} bytes is not "
                                    f"a whole number of {dt}")
            arrays[name] = np.frombuffer(raw, dtype=dt).astype(dt[1:], copy=True)
        names, causes = cols.get("names"), cols.get("causes")
        if not isinstance(names, list) or not all(type(s) is str for s in names):
            raise ProtocolError("cols 'names' is not a list of strings")
        if not isinstance(causes, list) or not all(isinstance(c, dict) for c in causes):
            raise ProtocolError("cols 'causes' is not a list of maps")
        if not isinstance(others, list):
            raise ProtocolError("batch 'events' is not a list")
        c = cls(**arrays, names=names, causes=causes, others=others)
        c.check()
        return c

    def check(self) -> None:
        """Raise ProtocolError unless the columns are consistent (see from_wire)."""
        n = len(self.kind)
        for name in ("tier", "seq", "arg"):
            if len(getattr(self, name)) != n:
                raise ProtocolError(f"cols {name!r} has {len(getattr(self, name))} "
                                    f"entries for {n} events")
        off, kind = self.off, self.kind
        if len(off) != n + 1 or off[0] != 0 or off[-1] != len(self.ids) or (
                n and (np.diff(off) < 0).any()):
            raise ProtocolError("cols 'off' are not offsets into 'ids'")
        if n and kind.max() > len(HOT_KINDS):
            raise ProtocolError(f"cols kind code {int(kind.max())} is unknown")
        if int((kind == OTHER).sum()) != len(self.others):
            raise ProtocolError(f"cols hold {int((kind == OTHER).sum())} other events, "
                                f"'events' {len(self.others)}")
        hot = kind != OTHER
        if (self.tier[hot & (kind != SEQ_TOKENS)] >= len(S.TIERS)).any():
            raise ProtocolError("cols tier code out of range")
        has_seq = (kind == ALLOC) | (kind == HIT) | (kind == FREE)
        seq = self.seq[has_seq]
        if seq.size and (seq.min() < 0 or seq.max() >= len(self.names)):
            raise ProtocolError("cols seq index out of range")
        lens = np.diff(off)
        tok = np.repeat(kind == SEQ_TOKENS, lens)
        if tok.any():
            sid = self.ids[tok]
            if sid.min() < 0 or sid.max() >= len(self.names):
                raise ProtocolError("cols seq_tokens name index out of range")
        if int(self.valued() @ lens) != len(self.vals):
            raise ProtocolError("cols 'vals' do not match the store/seq_tokens ids")
        ev = self.arg[kind == EVICT]
        if ev.size and (ev.min() < -1 or ev.max() >= len(self.causes)):
            raise ProtocolError("cols evict cause index out of range")
        if (self.arg[kind == HIT] < 0).any():
            raise ProtocolError("cols hit tokens negative")


class Rows:
    """The columns as Python lists (converted once per batch), to rebuild the events
    of any range of entries."""

    def __init__(self, c: StepColumns) -> None:
        self.c = c
        self.kinds, self.tiers = c.kind.tolist(), c.tier.tolist()
        self.seqs, self.args = c.seq.tolist(), c.arg.tolist()
        self.off = off = c.off.tolist()
        # per entry: where its vals start, and how many other events come before it (a
        # Python loop: most batches are small, where numpy's cost per call dominates)
        v = o = 0
        vstart, ostart = [0], [0]
        for i, k in enumerate(self.kinds):
            if k == STORE or k == SEQ_TOKENS:
                v += off[i + 1] - off[i]
            elif k == OTHER:
                o += 1
            vstart.append(v)
            ostart.append(o)
        self.vstart, self.ostart = vstart, ostart

    def events(self, a: int, b: int, packed: bool = False) -> list[Any]:
        """The events of entries [a, b), as plain maps (id lists packed: see
        ``StepColumns.to_events``)."""
        kinds, tiers, seqs, args, off = (
            self.kinds, self.tiers, self.seqs, self.args, self.off)
        c = self.c
        names, causes, others = c.names, c.causes, c.others
        o, v0 = self.ostart[a], self.vstart[a]
        base = off[a]  # the range's ids and vals, as lists, from its start
        raw = _pack(c.ids[base:off[b]], "<i4") if packed else b""
        ids = [] if packed else c.ids[base:off[b]].tolist()
        vals = c.vals[v0:self.vstart[b]].tolist()
        v = 0
        out: list[Any] = []
        for i in range(a, b):
            k = kinds[i]
            if k == OTHER:
                out.append(others[o])
                o += 1
                continue
            lst = (c.ids[off[i]:off[i + 1]].tolist() if packed and k == SEQ_TOKENS
                   else ids[off[i] - base:off[i + 1] - base])
            if k == SEQ_TOKENS:
                out.append({"kind": S.SEQ_TOKENS, "seqs": [names[j] for j in lst],
                            "num_tokens": vals[v:v + len(lst)]})
                v += len(lst)
                continue
            ev: dict[str, Any] = {"kind": HOT_KINDS[k - 1], "tier": S.TIERS[tiers[i]]}
            if k in SEQ_KINDS:
                ev["seq"] = names[seqs[i]]
            ev["blocks"] = (raw[4 * (off[i] - base):4 * (off[i + 1] - base)] if packed
                            else lst)
            if k == HIT:
                ev["tokens"] = args[i]
            elif k == STORE:
                n = off[i + 1] - off[i]
                ev["hashes"] = vals[v:v + n]
                v += n
            elif k == EVICT and args[i] >= 0:
                ev["cause"] = causes[args[i]]
            out.append(ev)
        return out


def _pack(a: np.ndarray, dt: str) -> bytes:
    return np.ascontiguousarray(a, dtype=dt).tobytes()


def _int_ids(value: Any) -> list[int] | None:
    """A wire id list as ints that fit int32, or None (then the event stays a map)."""
    if type(value) is bytes:
        if len(value) % 4:
            return None
        return np.frombuffer(value, dtype="<i4").tolist()
    if type(value) is not list:
        return None
    lo, hi = _I32
    for b in value:
        if type(b) is not int or not lo <= b <= hi:
            return None
    return value


def _ints64(value: Any) -> list[int] | None:
    if type(value) is not list:
        return None
    lo, hi = _I64
    for v in value:
        if type(v) is not int or not lo <= v <= hi:
            return None
    return value


class _Builder:
    """Accumulates one step's columns (plain lists; numpy once at ``build``)."""

    def __init__(self) -> None:
        self.kind: list[int] = []
        self.tier: list[int] = []
        self.seq: list[int] = []
        self.arg: list[int] = []
        self.off: list[int] = [0]
        self.ids: list[int] = []
        self.vals: list[int] = []
        self.names: list[str] = []
        self.name_idx: dict[str, int] = {}
        self.causes: list[Any] = []
        self.others: list[Any] = []

    def _name(self, sid: str) -> int:
        i = self.name_idx.get(sid)
        if i is None:
            i = self.name_idx[sid] = len(self.names)
            self.names.append(sid)
        return i

    def other(self, ev: Any) -> None:
        self.kind.append(OTHER)
        self.tier.append(0)
        self.seq.append(-1)
        self.arg.append(0)
        self.off.append(len(self.ids))
        self.others.append(ev)

    def add(self, ev: Any) -> bool:
        """Append ``ev`` as columns; False (nothing appended) if it does not fit them."""
        if type(ev) is not dict:
            return False
        code = KIND_CODE.get(ev.get("kind"))  # type: ignore[arg-type]
        if code is None:
            return False
        if code == SEQ_TOKENS:
            seqs, counts = ev.get("seqs"), _ints64(ev.get("num_tokens"))
            if (type(seqs) is not list or counts is None or len(seqs) != len(counts)
                    or not all(type(s) is str for s in seqs) or set(ev) - _TOKENS_FIELDS):
                return False
            self._row(code, 0, -1, 0, [self._name(s) for s in seqs])
            self.vals.extend(counts)
            return True
        tier = TIER_CODE.get(ev.get("tier"))  # type: ignore[arg-type]
        blocks = _int_ids(ev.get("blocks"))
        if tier is None or blocks is None or set(ev) - _FIELDS[code]:
            return False
        seq, arg = -1, 0
        if code in SEQ_KINDS:
            sid = ev.get("seq")
            if type(sid) is not str:
                return False
            seq = self._name(sid)
        if code == HIT:
            arg = ev.get("tokens", 0)
            if type(arg) is not int or not 0 <= arg <= _I64[1]:
                return False
        elif code == STORE:
            hashes = _ints64(ev.get("hashes"))
            if hashes is None or len(hashes) != len(blocks):
                return False
            self.vals.extend(hashes)
        elif code == EVICT and "cause" in ev:
            cause = ev["cause"]
            if type(cause) is not dict:
                return False
            arg = len(self.causes)
            self.causes.append(cause)
        elif code == EVICT:
            arg = -1
        self._row(code, tier, seq, arg, blocks)
        return True

    def _row(self, code: int, tier: int, seq: int, arg: int, ids: list[int]) -> None:
        self.kind.append(code)
        self.tier.append(tier)
        self.seq.append(seq)
        self.arg.append(arg)
        self.ids.extend(ids)
        self.off.append(len(self.ids))

    def build(self) -> StepColumns:
        return StepColumns(
            kind=np.array(self.kind, dtype=np.uint8), tier=np.array(self.tier, dtype=np.uint8),
            seq=np.array(self.seq, dtype=np.int32), arg=np.array(self.arg, dtype=np.int64),
            off=np.array(self.off, dtype=np.int32), ids=np.array(self.ids, dtype=np.int32),
            vals=np.array(self.vals, dtype=np.int64), names=self.names, causes=self.causes,
            others=self.others)


# the fields each hot kind may carry in columns (a "store" with vLLM detail, or any
# field the columns have no place for, keeps the event a map: nothing is lost)
_FIELDS = {
    ALLOC: {"kind", "tier", "seq", "blocks"},
    HIT: {"kind", "tier", "seq", "blocks", "tokens"},
    FREE: {"kind", "tier", "seq", "blocks"},
    STORE: {"kind", "tier", "blocks", "hashes"},
    EVICT: {"kind", "tier", "blocks", "cause"},
}
_TOKENS_FIELDS = {"kind", "seqs", "num_tokens"}
