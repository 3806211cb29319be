"""vLLM's page table, read at a step boundary, and the kvscope events that carry it.

Torch-free and vLLM-free: everything here takes vLLM's objects duck-typed (a
``Scheduler``, its ``kv_cache_manager.block_pool`` and single-type managers), so this
module imports nothing of vLLM and unit tests can drive it with plain objects.

``read_page_table(scheduler)`` is vLLM's own state in kvscope's terms (``PageTable``):

- one tier, "gpu": vLLM's ``BlockPool`` block ids as they are, block 0 included;
- a block's ref count is vLLM's ``ref_cnt`` (the null block, whose count vLLM does not
  keep, reads 1: it is always taken);
- a block's hash is vLLM's block hash as vLLM's own int form (the low 64 bits of the hash
  bytes, big-endian, as ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` publishes it), stored as
  the signed int64 with the same bits;
- a sequence per unfinished request and KV cache group: the request id for group 0,
  ``"<id>/g<k>"`` for group k of a hybrid model; its table is the group manager's
  ``req_to_blocks`` entry without null blocks (a sliding window's dropped blocks); running
  when vLLM's status is RUNNING, waiting otherwise; ``num_tokens`` is the request's
  ``num_computed_tokens``;
- ``RESERVED``: a sequence for the blocks vLLM holds without an unfinished request: the
  null block, deferred frees, blocks of finished requests a KV connector still reads.

``PageTableDiffer.step(new, sink, dirty)`` emits the events that take the previous page
table to ``new`` (``KVState.apply`` order rules: frees, then evictions, then table growth,
then stores) and keeps its own copy of ``new`` as its mirror; ``canonical()`` is that
mirror in ``KVState.canonical()`` form. With ``dirty`` (the block ids whose ref count or
hash may have changed since the last step, engine.events.vllm.tracker) it looks at those
blocks only, and a sequence whose table is the very list object of the last step is
taken as unchanged: the step costs what changed, not the pool. The invariant the
fidelity test checks against the real vLLM: after every step, the state rebuilt from
the events equals ``read_page_table`` of vLLM at that step (every block's ref count and
hash, every request's table, status and token count).

A step boundary sees the net change of a step: a block freed, evicted and taken again
within one step shows as free, evict and alloc, in that order, which is what happened;
a block whose hash left and came back with the same value within the step shows as a
hit. Nothing vLLM does between two boundaries is lost from the state, only from the
order within the step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from kvscope.engine.events import causes as C
from kvscope.engine.events import schema as S
from kvscope.engine.events.sink import EventSink

TIER = "gpu"
RESERVED = "vllm:reserved"  # the null block and blocks held without a live request
_MASK64 = (1 << 64) - 1
_FREE, _CACHED, _USED = 0, 1, 2  # a mirror block's class (step stats)


def hash_int(key: bytes | None) -> int | None:
    """vLLM's ``BlockHashWithGroupId`` (hash bytes + 4 group-id bytes) -> the signed int64
    whose bits are vLLM's int block hash (low 64 bits of the hash, big-endian)."""
    if key is None:
        return None
    h = int.from_bytes(key[:-4], "big") & _MASK64
    return h - (1 << 64) if h >> 63 else h


@dataclass(slots=True)
class SeqView:
    """One sequence of the page table."""

    status: str  # "running" | "waiting"
    table: list[int]
    num_tokens: int
    prompt_tokens: int = 0
    request: Any = None  # vLLM's Request (for finish reasons, counts); None for RESERVED


@dataclass
class PageTable:
    """vLLM's page table at one step boundary (see the module docstring)."""

    num_blocks: int
    block_size: int
    ref: list[int]
    keys: list[bytes | None]  # vLLM's hash keys per block (compared, converted lazily)
    seqs: dict[str, SeqView] = field(default_factory=dict)
    unexplained: int = 0  # refs no table explains (put in RESERVED; 0 when vLLM is known)


def group_seq_id(request_id: str, group: int) -> str:
    return request_id if group == 0 else f"{request_id}/g{group}"


def read_page_table(scheduler: Any, running_status: Any) -> PageTable:
    """vLLM's state now, from the scheduler's own structures (engine-core thread, at a
    step boundary). ``running_status``: vLLM's ``RequestStatus.RUNNING``."""
    kvm = scheduler.kv_cache_manager
    pool = kvm.block_pool
    blocks = pool.blocks
    ref = [b.ref_cnt for b in blocks]
    keys = [b._block_hash for b in blocks]
    null_id = pool.null_block.block_id
    ref[null_id] = 1
    managers = kvm.coordinator.single_type_managers
    block_size = managers[0].kv_cache_spec.block_size
    seqs: dict[str, SeqView] = {}
    held: list[list[int]] = []  # tables of the blocks RESERVED holds, before counting
    live = {rid: r for rid, r in scheduler.requests.items() if not r.is_finished()}
    for rid, r in live.items():
        status = "running" if r.status == running_status else "waiting"
        for g in range(len(managers)):
            seqs[group_seq_id(rid, g)] = SeqView(status, [], r.num_computed_tokens,
                                                 r.num_prompt_tokens, r)
    for g, mgr in enumerate(managers):
        for rid, rblocks in mgr.req_to_blocks.items():
            ids = [b.block_id for b in rblocks if not b.is_null]
            if rid in live:
                seqs[group_seq_id(rid, g)].table = ids
            else:
                held.append(ids)
    for _, dblocks in getattr(scheduler, "deferred_frees", ()):
        held.append([b.block_id for b in dblocks
                     if not b.is_null and getattr(b, "pool", pool) in (pool, None)])
    reserved = [null_id, *chain.from_iterable(held)]
    counts = Counter(chain.from_iterable(s.table for s in seqs.values()))
    counts.update(reserved)
    # Every ref explained (the common case) is checked without a pass over all blocks: no
    # block is counted more than its ref, and the totals agree.
    unexplained = sum(ref) - sum(counts.values())
    if unexplained or any(ref[b] < n for b, n in counts.items()):
        extra = [b for b, n in enumerate(ref) for _ in range(n - counts.get(b, 0))]
        unexplained = len(extra)
        reserved.extend(extra)
    seqs[RESERVED] = SeqView("running", reserved, 0)
    return PageTable(len(blocks), block_size, ref, keys, seqs, unexplained)


def canonical_of(pt: PageTable) -> dict[str, Any]:
    """``pt`` in ``KVState.canonical()`` form."""
    return {
        "tiers": {TIER: {
            "num_blocks": pt.num_blocks, "block_size": pt.block_size, "format": "auto",
            "ref": list(pt.ref), "hash": [hash_int(k) for k in pt.keys],
            "block_formats": {}}},
        "seqs": {sid: {"status": s.status, "tier": TIER, "block_table": list(s.table),
                       "num_tokens": s.num_tokens}
                 for sid, s in sorted(pt.seqs.items())},
    }


_FINISH = {"FINISHED_STOPPED": "stop", "FINISHED_LENGTH_CAPPED": "length",
           "FINISHED_REPETITION": "stop"}


def finish_reason(request: Any) -> str:
    """kvscope's finish reason for a finished vLLM request (anything else: abort)."""
    status = getattr(request, "status", None)
    return _FINISH.get(getattr(status, "name", ""), "abort")


class PageTableDiffer:
    """Turns successive ``PageTable`` reads into kvscope events (module docstring)."""

    def __init__(self) -> None:
        self.prev: PageTable | None = None
        # per block of the mirror: _FREE, _CACHED or _USED; and how many of each
        self._cls = bytearray()
        self._counts = [0, 0, 0]
        self._started: set[str] = set()  # sequences that have run once (resume vs start)
        # request id -> the cause ({} if unknown) of each preemption since the last step,
        # filled by the plugin's hook, emptied by step()
        self.preempt_causes: dict[str, dict[str, Any]] = {}
        self.reset_pending = False  # set by the plugin's reset_prefix_cache hook
        self.preemptions = 0
        self.evictions = 0
        self.hit_tokens = 0
        self.unrepresentable = 0  # steps whose change the protocol could not say in full

    def step(self, new: PageTable, sink: EventSink, dirty: set[int] | None = None) -> None:
        """Emit the events that take the last page table to ``new``; keep a copy of it.
        ``dirty``: the only blocks whose ref count or hash may differ from the last step's
        (None: any); a sequence whose ``table`` is the last step's list object is
        unchanged. Never keeps ``new``'s ref/keys lists (the tracker mutates them)."""
        emit = sink.emit
        prev = self.prev
        if prev is None or prev.num_blocks != new.num_blocks:
            dirty = None
            emit(S.TIER_INIT, tier=TIER, num_blocks=new.num_blocks,
                 block_size=new.block_size)
            prev = PageTable(new.num_blocks, new.block_size, [0] * new.num_blocks,
                             [None] * new.num_blocks, {})
            self._started = set()
            self._cls = bytearray(new.num_blocks)
            self._counts = [new.num_blocks, 0, 0]
        affected: set[int] | None = None if dirty is None else set(dirty)
        ref, keys = prev.ref, prev.keys
        old_seqs = prev.seqs
        tables: dict[str, list[int]] = {sid: s.table for sid, s in old_seqs.items()}
        tokens: dict[str, int] = {sid: s.num_tokens for sid, s in old_seqs.items()}

        # 1. new sequences; status changes; tables that did not just grow are dropped
        for sid, s in new.seqs.items():
            if sid not in old_seqs:
                emit(S.SEQ_ADD, seq=sid, prompt_tokens=s.prompt_tokens)
                tables[sid], tokens[sid] = [], 0
        # requests vLLM preempted in this step (the plugin's hook noted them) that are
        # running again at its end: re-admitted within the step (a reset_prefix_cache
        # that preempted every running request, then schedule()): preempted, freed, resumed
        causes = self.preempt_causes
        bounced: set[str] = set()
        for sid, old in old_seqs.items():
            s = new.seqs.get(sid)
            table = tables[sid]
            if s is not None and s.table is table and s.status == old.status:
                continue  # the tracker's unchanged table (the common case)
            rid = getattr(old.request, "request_id", None)
            bounce = (s is not None and rid in causes and old.status == "running"
                      and s.status == "running")
            if s is not None and old.status == "running" and (s.status == "waiting" or bounce):
                cause = causes.get(sid)
                self.preemptions += 1
                emit(S.SEQ_PREEMPT, seq=sid, mode="recompute",
                     **({"cause": cause} if cause else {}))
                if bounce:
                    bounced.add(sid)
            if table and (s is None or bounce or s.table[:len(table)] != table):
                emit(S.FREE, tier=TIER, seq=sid, blocks=table)
                for b in table:
                    ref[b] -= 1
                if affected is not None:
                    affected.update(table)
                tables[sid], tokens[sid] = [], 0
            if s is None:
                emit(S.SEQ_FINISH, seq=sid, reason=finish_reason(old.request),
                     num_tokens=old.num_tokens,
                     **_output_tokens(old.request))
                del tables[sid], tokens[sid]
                self._started.discard(sid)
        causes.clear()  # every preemption of this step is said (or its request is gone)
        for sid, s in new.seqs.items():
            if s.status == "running" and (sid not in old_seqs or sid in bounced
                                          or old_seqs[sid].status != "running"):
                emit(S.SEQ_RESUME if sid in self._started else S.SEQ_START, seq=sid)
                self._started.add(sid)

        # 2. evictions: blocks whose hash left (or changed while no one held them)
        new_keys = new.keys
        if dirty is not None:
            changed = sorted(b for b in dirty if keys[b] != new_keys[b])
        else:
            changed = [] if new_keys == keys else [
                b for b, (a, k) in enumerate(zip(keys, new_keys, strict=True)) if a != k]
        evicted = [b for b in changed if keys[b] is not None and ref[b] == 0]
        if evicted:
            cause = {C.REASON: C.R_RESET} if self.reset_pending else {
                C.REASON: C.R_ALLOCATE, C.POLICY: "lru"}
            emit(S.EVICT, tier=TIER, blocks=evicted, cause=cause)
            self.evictions += len(evicted)
            if affected is not None:
                affected.update(evicted)
            for b in evicted:
                keys[b] = None
        self.reset_pending = False

        # 3. tables grow: fresh blocks are allocs, cached ones hits
        for sid, s in new.seqs.items():
            table = tables[sid]
            if s.table is table:
                continue
            grow = s.table[len(table):]
            if not grow:
                continue
            if affected is not None:
                affected.update(grow)
            run: list[int] = []
            run_kind = None
            for b in grow:
                if ref[b] == 0 and keys[b] is None:
                    kind = S.ALLOC
                else:
                    if keys[b] is None:
                        if new_keys[b] is None:  # a shared block without a hash
                            self.unrepresentable += 1
                            continue
                        self._store(emit, [b], new_keys, keys)
                    kind = S.HIT
                if kind != run_kind and run:
                    self._grow(emit, sid, run_kind, run, new.block_size)
                    run = []
                run_kind = kind
                run.append(b)
                ref[b] += 1
            if run:
                self._grow(emit, sid, run_kind, run, new.block_size)
            tables[sid] = table + grow

        # 4. stores: hashes that arrived or changed
        stored = [b for b in changed if new_keys[b] is not None and keys[b] != new_keys[b]]
        if stored:
            self._store(emit, stored, new_keys, keys)

        # 5. token counts
        moved = [sid for sid, s in new.seqs.items() if tokens[sid] != s.num_tokens]
        if moved:
            emit(S.SEQ_TOKENS, seqs=moved, num_tokens=[new.seqs[s].num_tokens for s in moved])
        # What the protocol cannot say (a held block losing its hash, a block shared
        # without a hash) leaves the mirror behind vLLM: counted, and the mirror kept as
        # what the events said, so the stream stays valid.
        if affected is None:
            blocks_agree = ref == new.ref and keys == new_keys
        else:
            new_ref = new.ref
            blocks_agree = all(ref[b] == new_ref[b] and keys[b] == new_keys[b]
                               for b in affected)
        if blocks_agree and all(tables[sid] is s.table or tables[sid] == s.table
                                for sid, s in new.seqs.items()):
            seqs = dict(new.seqs)
        else:
            self.unrepresentable += 1
            seqs = {sid: SeqView(s.status, tables[sid], s.num_tokens, s.prompt_tokens,
                                 s.request) for sid, s in new.seqs.items()}
        self.prev = PageTable(new.num_blocks, new.block_size, ref, keys, seqs)
        self._count(range(new.num_blocks) if affected is None else affected)

    def _count(self, blocks: Iterable[int]) -> None:
        """Re-class ``blocks`` of the mirror (free / cached / used) and keep the counts."""
        ref, keys, cls, counts = self.prev.ref, self.prev.keys, self._cls, self._counts
        for b in blocks:
            c = _USED if ref[b] else (_FREE if keys[b] is None else _CACHED)
            if c != cls[b]:
                counts[cls[b]] -= 1
                counts[c] += 1
                cls[b] = c

    def _grow(self, emit: Any, sid: str, kind: str | None, run: list[int],
              block_size: int) -> None:
        if kind == S.ALLOC:
            emit(S.ALLOC, tier=TIER, seq=sid, blocks=run)
        else:
            n = len(run) * block_size if sid != RESERVED else 0
            self.hit_tokens += n
            emit(S.HIT, tier=TIER, seq=sid, blocks=run, tokens=n)

    @staticmethod
    def _store(emit: Any, blocks: list[int], new_keys: list[bytes | None],
               keys: list[bytes | None]) -> None:
        for b in blocks:
            keys[b] = new_keys[b]
        emit(S.STORE, tier=TIER, blocks=blocks, hashes=[hash_int(keys[b]) for b in blocks])

    def canonical(self) -> dict[str, Any]:
        """The mirror (the state the events so far describe) in canonical form."""
        if self.prev is None:
            return {"tiers": {}, "seqs": {}}
        return canonical_of(self.prev)

    def block_counts(self) -> dict[str, int]:
        """{"total", "used", "cached", "free"} blocks of the mirror (step stats)."""
        pt = self.prev
        if pt is None:
            return {}
        free, cached, used = self._counts
        return {"total": pt.num_blocks, "used": used, "cached": cached, "free": free}


def _output_tokens(request: Any) -> dict[str, int]:
    n = getattr(request, "num_output_tokens", None)
    return {"output_tokens": int(n)} if isinstance(n, int) else {}


def ids(blocks: Iterable[Any]) -> list[int]:
    """Block ids of vLLM ``KVCacheBlock`` objects."""
    return [b.block_id for b in blocks]
