"""KVState: the mirror of a kvscope KV cache, rebuilt from events.

``KVState.apply(batch)`` is the single definition of what each event means (the kinds
are listed in ``engine.events.schema``). The inspector draws from a KVState; the tests
rebuild one from the engine's events and compare ``canonical()`` with the engine's own
``kv_state()`` after every step.

The page table is held as flat per-tier arrays (``TierState``, in ``state_store``): ref
count, prefix-cache hash (value + presence), owner, per-block format and the step of the
last change. Sequence bookkeeping stays in dicts (``SeqState``).

Invariants the mirror keeps (and ``apply`` enforces, raising ProtocolError otherwise):
- every sequence's block table lives in one tier (``seq.tier``) and points at blocks of
  that tier with ref > 0;
- a block's ref count equals the number of block-table entries pointing at it;
- only blocks with ref 0 can be evicted; ``alloc``/``cow`` destinations are free
  (ref 0, no hash).
Bounded by construction (``state_store``'s limits, each checked before anything is
allocated and refused like any other bad batch, the state left as it was):
- at most ``MAX_TIER_BLOCKS`` blocks a pool and ``MAX_TOTAL_BLOCKS`` over all pools (a
  batch's or snapshot's declared geometry, ``_check_geometry``/``from_snapshot``);
- at most ``MAX_SEQS`` live sequences (``seq_add`` past it is refused).
A batch is applied atomically: if any event in it is rejected, the state is unchanged
(an undo journal of the old values at the ids each handler overwrites: cost in proportion
to what a batch touches, never to the cache's size).

Owner (display only, not part of ``canonical()``): one sequence holding the block, as
``seq_owner_id(seq)``: the one that took it from ref 0 (alloc, a hit on an unheld cached
block, cow/host_hit/swap destinations); -1 when nobody holds it; ``ORPHAN`` when its
taker released it while others still hold it (``resolve_owners`` finds a holder for
those with one pass over the tier's block tables, when a view asks). A state rebuilt from
a snapshot assigns each held block to the first sequence whose table points at it.

Where each part lives (one job a module; ``KVState`` is assembled from mixins, each
importing only the one below it, so there is no import circle):
- ``state_store``: the storage (``Column``, ``TierState``, ``SeqState``) and the wire form
  of id lists (``pack_ids``/``unpack_ids``);
- ``state_journal``: the undo journal and the rollback (``UndoJournal``);
- ``state_blocks``: the block writes, the one ref-count path among them (``BlockWrites``);
- ``state_groups``: the handlers of events for cache groups other than 0;
- ``state_handlers``: one handler per event kind and the dispatch (``HANDLERS``);
- this module: ``KVState`` itself (reading, ``canonical()``, snapshots, ``clone()``, the
  transaction around ``apply``); ``state_columns``: the columnar apply, held equal to it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvscope.engine.events import schema as S
from kvscope.engine.events.schema import ProtocolError
from kvscope.engine.events.state_handlers import HANDLERS, EventHandlers
from kvscope.engine.events.state_store import (
    MAX_SEQS,
    MAX_TIER_BLOCKS,
    MAX_TOTAL_BLOCKS,
    NEVER,
    ORPHAN,
    Column,
    SeqState,
    TierState,
    format_code,
    pack_ids,
    seq_owner_id,
    unpack_ids,
)

# the names this module has always offered (``from kvscope.engine.events.state import``)
__all__ = [
    "KVState", "Canonical", "TierState", "SeqState", "Column", "pack_ids", "unpack_ids",
    "seq_owner_id", "ORPHAN", "NEVER", "MAX_TIER_BLOCKS", "MAX_TOTAL_BLOCKS", "MAX_SEQS",
    "ProtocolError",
]

_DIRTY_SLACK = 4096  # see KVState._dirty_seqs


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


class KVState(EventHandlers):
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
        # the batch being applied, for the geometry check at its first tier_init
        # (None once done; see _check_geometry)
        self._geometry_of: Any = None

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
            _check_snapshot_size(snap)
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
                    tier.fmt_c.py[b] = format_code(tier, str(f))
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
            # tier_init is never a hot kind: the columns' others hold every one
            self._geometry_of = getattr(cols, "others", None)
            try:
                apply_columns(self, batch, cols)
            finally:
                self._geometry_of = None  # never holds a batch past its apply
            return
        events = batch.get("events", [])
        if not isinstance(events, list):
            raise ProtocolError("batch 'events' is not a list")
        self._geometry_of = events  # checked at the batch's first tier_init, if any
        self._begin_step(batch)
        try:
            self._apply_events(events)
        except ProtocolError:
            self._rollback()
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as e:
            self._rollback()
            raise ProtocolError(f"malformed event: {e!r}") from e
        finally:
            self._geometry_of = None
        self._commit(batch)

    def _check_geometry(self, events: Any) -> None:
        """Refuse a batch whose tier_init events would take the mirror past
        ``MAX_TOTAL_BLOCKS``, before any of them allocates anything: the handler of a
        batch's first tier_init calls this with the whole batch (``_geometry_of``, set
        by ``apply`` on both paths), so a batch without one pays nothing.

        The batch's geometry: every tier_init's ``num_blocks`` (a pool declared twice
        counts twice: each one is allocated while the replaced one waits in the undo
        journal) plus the blocks of the pools it leaves as they are. That bounds both
        what the batch allocates and the mirror after it. Malformed tier_init events
        are skipped here: their handler refuses them with its own message."""
        if type(events) is not list:
            return  # not a batch: refused later with the usual message
        declared: list[tuple[str, int]] = []
        for ev in events:
            if type(ev) is not dict or ev.get("kind") != S.TIER_INIT:
                continue
            try:
                name, n = ev["tier"], int(ev["num_blocks"])
                g = ev.get("group", 0)
                if name not in S.TIERS or type(g) is not int or not 0 <= g < 64:
                    continue
            except (KeyError, TypeError, ValueError, OverflowError):
                continue
            if 0 <= n <= MAX_TIER_BLOCKS:
                declared.append((S.group_pool(name, g), n))
        if not declared:
            return
        names = {name for name, _ in declared}
        kept = sum(t.num_blocks for name, t in self.tiers.items() if name not in names)
        total = kept + sum(n for _, n in declared)
        if total > MAX_TOTAL_BLOCKS:
            raise ProtocolError(
                f"tier_init: {len(declared)} pools declare {total} blocks with those kept "
                f"(a mirror holds at most {MAX_TOTAL_BLOCKS} blocks over all its tiers "
                "and groups); batch refused")

    def _begin_step(self, batch: dict[str, Any]) -> None:
        step = batch.get("step", self.step + 1)
        self._cur_step = step if type(step) is int and -(1 << 31) <= step < (1 << 31) else -1
        self._begin()

    def _apply_events(self, events: list[Any]) -> None:
        """The reference: each event's handler, in order (inside a _begin/_commit)."""
        handlers, counts = HANDLERS, self.kind_counts
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


def _check_snapshot_size(snap: dict[str, Any]) -> None:
    """Refuse a snapshot past the mirror's limits before building anything from it:
    its tiers' declared blocks together (``MAX_TOTAL_BLOCKS``) and its sequences
    (``MAX_SEQS``). A bad shape is left to the parser that follows."""
    tiers, seqs = snap.get("tiers"), snap.get("seqs")
    if isinstance(tiers, dict):
        total = 0
        for t in tiers.values():
            try:
                total += max(0, int(t["num_blocks"]))
            except (KeyError, TypeError, ValueError, OverflowError):
                continue
        if total > MAX_TOTAL_BLOCKS:
            raise ProtocolError(
                f"snapshot: {len(tiers)} tiers declare {total} blocks (a mirror holds at "
                f"most {MAX_TOTAL_BLOCKS} blocks over all its tiers and groups)")
    if isinstance(seqs, list) and len(seqs) > MAX_SEQS:
        raise ProtocolError(f"snapshot: {len(seqs)} sequences (a mirror holds at most "
                            f"{MAX_SEQS} live sequences)")


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
