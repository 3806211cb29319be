"""KVState: the mirror of a kvscope KV cache, rebuilt from events.

``KVState.apply(batch)`` is the single definition of what each event means (the kinds
are listed in ``engine.events.schema``). The inspector draws from a KVState; the tests
rebuild one from the engine's events and compare ``canonical()`` with the engine's own
``kv_state()`` after every step.

Invariants the mirror keeps (and ``apply`` enforces, raising ProtocolError otherwise):
- every sequence's block table lives in one tier (``seq.tier``) and points at blocks of
  that tier with ref > 0;
- a block's ref count equals the number of block-table entries pointing at it;
- only blocks with ref 0 can be evicted; ``alloc``/``cow`` destinations are free
  (ref 0, no hash).
A batch is applied atomically: if any event in it is rejected, the state is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.events import schema as S
from engine.events.schema import ProtocolError


@dataclass
class TierState:
    """One physical block pool: per-block ref counts and prefix-cache hashes."""

    name: str
    num_blocks: int
    block_size: int
    format: str = "auto"
    ref: np.ndarray = field(default=None)  # int32 [num_blocks]
    hashes: dict[int, int] = field(default_factory=dict)  # block id -> hash (cached blocks)
    # block id -> format, only for blocks whose format differs from the tier's (quantize)
    formats: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.ref is None:
            self.ref = np.zeros(self.num_blocks, dtype=np.int32)

    def check_ids(self, blocks: list[int]) -> None:
        for b in blocks:
            # bool is an int, and numpy would read ref[True] as a mask over every block
            if not isinstance(b, int) or isinstance(b, bool) or not 0 <= b < self.num_blocks:
                raise ProtocolError(f"tier {self.name}: block id {b!r} out of range")


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


class KVState:
    """The cache mirror. Cheap to copy via ``clone()`` (used by seek keyframes)."""

    def __init__(self) -> None:
        self.tiers: dict[str, TierState] = {}
        self.seqs: dict[str, SeqState] = {}
        self.step: int = -1
        self.time: float = 0.0
        self.stats: dict[str, Any] = {}
        self.kind_counts: dict[str, int] = {}  # cumulative events applied, by kind
        self.unknown_kinds: int = 0
        self._undo: list[tuple] | None = None  # a list only while apply() runs

    # ------------------------------------------------------------------ reading
    def block_codes(self, tier: str) -> np.ndarray:
        """uint8 state code per block (schema.BLOCK_*), vectorised for 1M-block maps."""
        t = self.tiers[tier]
        codes = np.zeros(t.num_blocks, dtype=np.uint8)
        if t.hashes:
            codes[np.fromiter(t.hashes.keys(), dtype=np.int64, count=len(t.hashes))] = (
                S.BLOCK_CACHED
            )
        codes[t.ref == 1] = S.BLOCK_USED
        codes[t.ref > 1] = S.BLOCK_SHARED
        return codes

    def owners(self, tier: str, block: int) -> list[str]:
        """Sequences whose block table points at ``block`` (for hover/click)."""
        return [
            s.seq_id for s in self.seqs.values() if s.tier == tier and block in s.block_table
        ]

    def canonical(self) -> dict[str, Any]:
        """Plain-dict form for equality checks; same shape as ``LLMEngine.kv_state()``."""
        return {
            "tiers": {
                name: {
                    "num_blocks": t.num_blocks,
                    "block_size": t.block_size,
                    "format": t.format,
                    "ref": t.ref.tolist(),
                    "hash": [t.hashes.get(b) for b in range(t.num_blocks)],
                    "block_formats": dict(sorted(t.formats.items())),
                }
                for name, t in sorted(self.tiers.items())
            },
            "seqs": {
                sid: {
                    "status": s.status,
                    "tier": s.tier,
                    "block_table": list(s.block_table),
                    "num_tokens": s.num_tokens,
                }
                for sid, s in sorted(self.seqs.items())
            },
        }

    # ------------------------------------------------------------- snapshots
    def snapshot(self) -> dict[str, Any]:
        """Full state as a msgpack-friendly map (str keys only); see ``from_snapshot``."""
        return {
            "v": S.PROTOCOL_VERSION,
            "step": self.step,
            "time": self.time,
            "stats": self.stats,
            "tiers": {
                name: {
                    "num_blocks": t.num_blocks,
                    "block_size": t.block_size,
                    "format": t.format,
                    "ref": t.ref.tolist(),
                    "hashed": list(t.hashes.keys()),
                    "hashes": list(t.hashes.values()),
                    "block_formats": {str(b): f for b, f in t.formats.items()},
                }
                for name, t in self.tiers.items()
            },
            "seqs": [
                {
                    "seq": s.seq_id, "status": s.status, "tier": s.tier,
                    "block_table": list(s.block_table), "num_tokens": s.num_tokens,
                    "prompt_tokens": s.prompt_tokens, "priority": s.priority,
                    "parent": s.parent, "preemptions": s.preemptions,
                    "hit_tokens": s.hit_tokens,
                }
                for s in self.seqs.values()
            ],
            "kind_counts": dict(self.kind_counts),
        }

    @classmethod
    def from_snapshot(cls, snap: dict[str, Any]) -> KVState:
        if snap.get("v") != S.PROTOCOL_VERSION:
            raise ProtocolError(
                f"snapshot protocol version {snap.get('v')!r}, expected {S.PROTOCOL_VERSION}"
            )
        st = cls()
        try:
            st.step = int(snap["step"])
            st.time = float(snap.get("time", 0.0))
            st.stats = dict(snap.get("stats") or {})
            for name, t in snap["tiers"].items():
                tier = TierState(name, int(t["num_blocks"]), int(t["block_size"]), t["format"])
                ref = np.asarray(t["ref"], dtype=np.int32)
                if ref.shape != (tier.num_blocks,):
                    raise ProtocolError(f"snapshot tier {name}: ref has {ref.shape} entries")
                tier.ref = ref
                tier.hashes = dict(zip(t["hashed"], t["hashes"], strict=True))
                tier.formats = {int(b): str(f) for b, f in
                                (t.get("block_formats") or {}).items()}
                st.tiers[name] = tier
            for s in snap["seqs"]:
                st.seqs[s["seq"]] = SeqState(
                    seq_id=s["seq"], status=s["status"], tier=s["tier"],
                    block_table=list(s["block_table"]), num_tokens=int(s["num_tokens"]),
                    prompt_tokens=int(s.get("prompt_tokens", 0)),
                    priority=int(s.get("priority", 0)), parent=s.get("parent"),
                    preemptions=int(s.get("preemptions", 0)),
                    hit_tokens=int(s.get("hit_tokens", 0)),
                )
            st.kind_counts = dict(snap.get("kind_counts") or {})
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, ProtocolError):
                raise
            raise ProtocolError(f"malformed snapshot: {e!r}") from e
        return st

    @classmethod
    def from_canonical(cls, canon: dict[str, Any]) -> KVState:
        """A KVState from ``canonical()``/``kv_state()`` form (what canonical() leaves out,
        such as priorities, parents and counters, starts at its defaults)."""
        snap = {
            "v": S.PROTOCOL_VERSION, "step": -1,
            "tiers": {
                name: {"num_blocks": t["num_blocks"], "block_size": t["block_size"],
                       "format": t["format"], "ref": t["ref"],
                       "hashed": [b for b, h in enumerate(t["hash"]) if h is not None],
                       "hashes": [h for h in t["hash"] if h is not None],
                       "block_formats": t.get("block_formats") or {}}
                for name, t in canon["tiers"].items()
            },
            "seqs": [{"seq": sid, **s} for sid, s in canon["seqs"].items()],
        }
        return cls.from_snapshot(snap)

    def clone(self) -> KVState:
        """An independent copy: arrays, dicts and block tables are copied, not shared."""
        st = KVState()
        st.tiers = {
            n: TierState(t.name, t.num_blocks, t.block_size, t.format, t.ref.copy(),
                         dict(t.hashes), dict(t.formats))
            for n, t in self.tiers.items()
        }
        st.seqs = {sid: _copy_seq(s) for sid, s in self.seqs.items()}
        st.step, st.time, st.stats = self.step, self.time, self.stats
        st.kind_counts, st.unknown_kinds = dict(self.kind_counts), self.unknown_kinds
        return st

    # ----------------------------------------------------------------- apply
    def apply(self, batch: dict[str, Any]) -> None:
        """Apply one step's batch. Atomic: on ProtocolError the state is unchanged.

        Atomicity comes from an undo log (what each handler is about to overwrite), so
        a batch costs time in proportion to what it touches, not to the cache's size.
        """
        if not isinstance(batch, dict) or batch.get("v") != S.PROTOCOL_VERSION:
            raise ProtocolError(
                f"batch protocol version {getattr(batch, 'get', lambda _k: None)('v')!r}, "
                f"expected {S.PROTOCOL_VERSION}"
            )
        events = batch.get("events", [])
        if not isinstance(events, list):
            raise ProtocolError("batch 'events' is not a list")
        self._begin()
        try:
            for ev in events:
                self._apply_event(ev)
        except ProtocolError:
            self._rollback()
            raise
        except (KeyError, TypeError, ValueError, IndexError, AttributeError, OverflowError) as e:
            self._rollback()
            raise ProtocolError(f"malformed event: {e!r}") from e
        self._undo = None
        self.step = int(batch.get("step", self.step + 1))
        self.time = float(batch.get("time", self.time))
        stats = batch.get("stats")
        if isinstance(stats, dict):
            self.stats = stats

    # ------------------------------------------------------------- undo log
    # Every mutation inside apply() first logs what it overwrites: _seq saves a sequence's
    # fields the first time a batch touches it, _save_ref the old ref counts of the blocks
    # about to change, _save_hash an old hash entry, _save_item a tier or sequence about
    # to appear or disappear, _save_attr one field. _rollback replays the log backwards,
    # restoring objects in place, so entries logged in any order compose.
    def _begin(self) -> None:
        self._undo = []
        self._touched: set[str] = set()
        self._seq_order: list[str] | None = None  # saved before the first seq_finish
        self._whole_ref_saved: set[int] = set()  # id() of ref arrays copied whole
        self._saved_counts = (dict(self.kind_counts), self.unknown_kinds)

    def _save_ref(self, t: TierState, blocks: list[int]) -> None:
        if self._undo is None or id(t.ref) in self._whole_ref_saved:
            return
        if t.num_blocks <= _WHOLE_REF_COPY_MAX:  # one memcpy per tier and batch
            self._whole_ref_saved.add(id(t.ref))
            self._undo.append((_REF, t.ref, slice(None), t.ref.copy()))
        else:  # huge tiers: only the blocks this event touches
            self._undo.append((_REF, t.ref, blocks, t.ref[blocks]))

    def _save_hash(self, t: TierState, b: int) -> None:
        if self._undo is not None:
            self._undo.append((_ITEM, t.hashes, b, t.hashes.get(b, _MISSING)))

    def _save_item(self, d: dict, key: Any) -> None:
        if self._undo is not None:
            self._undo.append((_ITEM, d, key, d.get(key, _MISSING)))

    def _save_attr(self, obj: Any, name: str) -> None:
        if self._undo is not None:
            self._undo.append((_ATTR, obj, name, getattr(obj, name)))

    def _rollback(self) -> None:
        undo, self._undo = self._undo or [], None
        for op, target, key, old in reversed(undo):
            if op is _REF:
                target[key] = old
            elif op is _ITEM:
                if old is _MISSING:
                    target.pop(key, None)
                else:
                    target[key] = old
            elif op is _SEQ:
                target.__dict__.update(old)
            elif op is _TOKENS:
                for seq, n in zip(target, old, strict=True):
                    seq.num_tokens = n
            else:
                setattr(target, key, old)
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
        s = self.seqs.get(sid)
        if s is None:
            raise ProtocolError(f"unknown sequence {sid!r}")
        if self._undo is not None and sid not in self._touched:
            self._touched.add(sid)
            saved = s.__dict__.copy()
            saved["block_table"] = list(s.block_table)
            self._undo.append((_SEQ, s, None, saved))
        return s

    def _apply_event(self, ev: dict[str, Any]) -> None:
        kind = ev["kind"]
        handler = _HANDLERS.get(kind)
        if handler is None:
            self.unknown_kinds += 1
            return
        handler(self, ev)
        self.kind_counts[kind] = self.kind_counts.get(kind, 0) + 1

    # One method per kind. Each validates before it mutates what it touches.
    def _tier_init(self, ev: dict[str, Any]) -> None:
        name = ev["tier"]
        if name not in S.TIERS:
            raise ProtocolError(f"unknown tier {name!r}")
        n, bs = int(ev["num_blocks"]), int(ev["block_size"])
        if n < 0 or bs < 1:
            raise ProtocolError(f"tier {name}: bad size {n} blocks x {bs} tokens")
        self._save_item(self.tiers, name)
        self.tiers[name] = TierState(name, n, bs, str(ev.get("format", "auto")))

    def _seq_add(self, ev: dict[str, Any]) -> None:
        sid = ev["seq"]
        if not isinstance(sid, str) or sid in self.seqs:
            raise ProtocolError(f"seq_add: bad or duplicate sequence id {sid!r}")
        self._save_item(self.seqs, sid)
        self.seqs[sid] = SeqState(
            seq_id=sid, prompt_tokens=int(ev.get("prompt_tokens", 0)),
            priority=int(ev.get("priority", 0)), parent=ev.get("parent"),
        )

    def _seq_start(self, ev: dict[str, Any]) -> None:
        self._seq(ev["seq"]).status = "running"

    def _alloc(self, ev: dict[str, Any]) -> None:
        t, s, blocks = self._tier(ev["tier"]), self._seq(ev["seq"]), list(ev["blocks"])
        t.check_ids(blocks)
        self._require_table_tier(s, t)
        for b in blocks:
            if t.ref[b] != 0 or b in t.hashes:
                raise ProtocolError(f"alloc: {t.name} block {b} is not free")
        if len(set(blocks)) != len(blocks):
            raise ProtocolError("alloc: duplicate block ids")
        self._save_ref(t, blocks)
        t.ref[blocks] = 1
        s.block_table.extend(blocks)

    def _hit(self, ev: dict[str, Any]) -> None:
        t, s, blocks = self._tier(ev["tier"]), self._seq(ev["seq"]), list(ev["blocks"])
        t.check_ids(blocks)
        self._require_table_tier(s, t)
        for b in blocks:
            if b not in t.hashes:
                raise ProtocolError(f"hit: {t.name} block {b} is not cached")
        self._save_ref(t, blocks)
        _add(t.ref, blocks, 1)
        s.block_table.extend(blocks)
        s.hit_tokens += int(ev.get("tokens", 0))

    def _store(self, ev: dict[str, Any]) -> None:
        t, blocks, hashes = self._tier(ev["tier"]), list(ev["blocks"]), list(ev["hashes"])
        t.check_ids(blocks)
        if len(blocks) != len(hashes):
            raise ProtocolError("store: blocks and hashes differ in length")
        for b, h in zip(blocks, hashes, strict=True):
            self._save_hash(t, b)
            t.hashes[b] = int(h)

    def _evict(self, ev: dict[str, Any]) -> None:
        t, blocks = self._tier(ev["tier"]), list(ev["blocks"])
        t.check_ids(blocks)
        for b in blocks:
            if t.ref[b] != 0 or b not in t.hashes:
                raise ProtocolError(f"evict: {t.name} block {b} is not a cached free block")
        for b in blocks:
            self._save_hash(t, b)
            del t.hashes[b]
        self._drop_formats(t, blocks)

    def _free(self, ev: dict[str, Any]) -> None:
        t, s, blocks = self._tier(ev["tier"]), self._seq(ev["seq"]), list(ev["blocks"])
        if s.tier != t.name or blocks != s.block_table:
            raise ProtocolError(f"free: {s.seq_id} does not hold exactly {t.name} {blocks}")
        self._save_ref(t, blocks)
        _add(t.ref, blocks, -1)
        s.block_table = []
        s.num_tokens = 0
        self._drop_formats(t, blocks)

    def _fork(self, ev: dict[str, Any]) -> None:
        t, s, parent = self._tier(ev["tier"]), self._seq(ev["seq"]), self._seq(ev["parent"])
        blocks = list(ev["blocks"])
        if parent.tier != t.name or blocks != parent.block_table or s.block_table:
            raise ProtocolError(f"fork: {s.seq_id} cannot share {parent.seq_id}'s blocks")
        s.tier = t.name
        self._save_ref(t, blocks)
        _add(t.ref, blocks, 1)
        s.block_table = blocks
        s.num_tokens = parent.num_tokens

    def _cow(self, ev: dict[str, Any]) -> None:
        t, s = self._tier(ev["tier"]), self._seq(ev["seq"])
        logical, src, dst = list(ev["logical"]), list(ev["src"]), list(ev["dst"])
        t.check_ids(src + dst)
        if not len(logical) == len(src) == len(dst):
            raise ProtocolError("cow: logical, src and dst differ in length")
        for i, a, b in zip(logical, src, dst, strict=True):
            if not 0 <= i < len(s.block_table) or s.block_table[i] != a:
                raise ProtocolError(f"cow: {s.seq_id}[{i}] is not block {a}")
            if t.ref[b] != 0 or b in t.hashes:
                raise ProtocolError(f"cow: destination block {b} is not free")
            self._save_ref(t, [a, b])
            s.block_table[i] = b
            t.ref[a] -= 1
            t.ref[b] = 1

    def _seq_tokens(self, ev: dict[str, Any]) -> None:
        seqs, counts = list(ev["seqs"]), [int(n) for n in ev["num_tokens"]]
        if len(seqs) != len(counts):
            raise ProtocolError("seq_tokens: seqs and num_tokens differ in length")
        # the hot path of every decode step: one undo entry for all, not a copy per seq
        table = self.seqs
        try:
            objs = [table[sid] for sid in seqs]
        except (KeyError, TypeError):
            missing = next(sid for sid in seqs if not isinstance(sid, str) or sid not in table)
            raise ProtocolError(f"unknown sequence {missing!r}") from None
        if self._undo is not None:
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
        if self._undo is not None and self._seq_order is None:
            self._seq_order = list(self.seqs)
        self._save_item(self.seqs, s.seq_id)
        del self.seqs[s.seq_id]

    def _move(self, ev: dict[str, Any], src_tier: str, dst_tier: str) -> None:
        s = self._seq(ev["seq"])
        a, b = self._tier(src_tier), self._tier(dst_tier)
        src, dst = list(ev["src"]), list(ev["dst"])
        a.check_ids(src)
        b.check_ids(dst)
        if s.tier != src_tier or src != s.block_table or len(dst) != len(src):
            raise ProtocolError(f"{ev['kind']}: {s.seq_id} does not hold {src_tier} {src}")
        self._save_ref(a, src)
        self._save_ref(b, dst)
        _add(a.ref, src, -1)
        _add(b.ref, dst, 1)
        s.tier, s.block_table = dst_tier, dst
        self._drop_formats(a, src)

    def _quantize(self, ev: dict[str, Any]) -> None:
        """Demotion: the blocks' format changes in place; refs, hashes and tables do not.
        Only blocks holding K/V (ref > 0 or cached) can be quantized; a block's format
        reverts to the tier's when it becomes free (``_drop_formats``)."""
        t, blocks, fmt = self._tier(ev["tier"]), list(ev["blocks"]), ev["format"]
        t.check_ids(blocks)
        if fmt not in S.KV_FORMATS:
            raise ProtocolError(f"quantize: unknown format {fmt!r}")
        for b in blocks:
            if t.ref[b] == 0 and b not in t.hashes:
                raise ProtocolError(f"quantize: {t.name} block {b} is free")
        for b in blocks:
            self._save_item(t.formats, b)
            if fmt == t.format:
                t.formats.pop(b, None)
            else:
                t.formats[b] = fmt

    def _drop_formats(self, t: TierState, blocks: list[int]) -> None:
        """Blocks that became free (ref 0, unhashed) lose their page, hence their format."""
        if not t.formats:
            return
        for b in blocks:
            if b in t.formats and t.ref[b] == 0 and b not in t.hashes:
                self._save_item(t.formats, b)
                del t.formats[b]

    def _swap_out(self, ev: dict[str, Any]) -> None:
        self._move(ev, "gpu", "cpu")

    def _swap_in(self, ev: dict[str, Any]) -> None:
        self._move(ev, "cpu", "gpu")

    def _offload(self, ev: dict[str, Any]) -> None:
        host = self._tier("cpu")
        dst, hashes = list(ev["dst"]), list(ev["hashes"])
        host.check_ids(dst)
        if len(dst) != len(hashes):
            raise ProtocolError("offload: dst and hashes differ in length")
        for b, h in zip(dst, hashes, strict=True):
            if host.ref[b] != 0:
                raise ProtocolError(f"offload: host block {b} is in use")
            self._save_hash(host, b)
            host.hashes[b] = int(h)

    def _host_hit(self, ev: dict[str, Any]) -> None:
        host, dev, s = self._tier("cpu"), self._tier("gpu"), self._seq(ev["seq"])
        src, dst = list(ev["src"]), list(ev["dst"])
        host.check_ids(src)
        dev.check_ids(dst)
        self._require_table_tier(s, dev)
        if len(src) != len(dst):
            raise ProtocolError("host_hit: src and dst differ in length")
        for a, b in zip(src, dst, strict=True):
            if a not in host.hashes:
                raise ProtocolError(f"host_hit: host block {a} is not cached")
            if dev.ref[b] != 0 or b in dev.hashes:
                raise ProtocolError(f"host_hit: gpu block {b} is not free")
            self._save_ref(dev, [b])
            self._save_hash(dev, b)
            dev.ref[b] = 1
            dev.hashes[b] = host.hashes[a]
        s.block_table.extend(dst)
        s.hit_tokens += int(ev.get("tokens", 0))

    def _require_table_tier(self, s: SeqState, t: TierState) -> None:
        if s.block_table and s.tier != t.name:
            raise ProtocolError(f"{s.seq_id}'s table is in tier {s.tier}, not {t.name}")
        s.tier = t.name


_MISSING = object()  # undo-log marker: "this key did not exist"
_REF, _ITEM, _SEQ, _ATTR, _TOKENS = "ref", "item", "seq", "attr", "tokens"  # undo entries
_WHOLE_REF_COPY_MAX = 1 << 16  # up to this many blocks, undo copies a tier's refs whole


def _add(ref: np.ndarray, blocks: list[int], delta: int) -> None:
    """ref[blocks] += delta, duplicates counted (np.add.at costs ~10 us even for 1 id)."""
    if len(blocks) <= 8:
        for b in blocks:
            ref[b] += delta
    else:
        np.add.at(ref, blocks, delta)


def _copy_seq(s: SeqState) -> SeqState:
    c = SeqState.__new__(SeqState)
    c.__dict__.update(s.__dict__)
    c.block_table = list(s.block_table)
    return c


_HANDLERS = {
    S.TIER_INIT: KVState._tier_init,
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
}
