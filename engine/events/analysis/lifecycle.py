"""LifecycleIndex: what happened to each request, and what it cost, from events alone.

An index over a stream of batches (engine.events.schema), built incrementally: ``add``
one batch at a time (live), or ``for_recording`` once over a whole recording (replay;
cached per file). Torch-free; costs time in proportion to the events, not to the cache.

Per sequence (``SeqLife``): its phases (``PHASES``, run-length: a new phase starts only
when an event changes what the sequence is doing), block count and prefix-hit tokens over
time, preemptions with their causes, its disk prefetches (``PrefetchSpan``: reads started
-> arrived, or the wait given up and the rest recomputed), first-token and finish steps
and times, TTFT, TPOT.
Per step (``steps``, columnar): gauges and per-step counts the range summary and the
counter tracks read.

Token accounting (shared with the engine's own counter, ``classify_chunk``): a sequence
computes positions [a, b) in a step. The chunk is *prefill* unless it is a single new
token past both the prompt and every position computed before (a decode). Positions
below the sequence's high-water mark are *recomputed* (they were computed before a
recompute preemption freed them, and the prefix cache no longer held them). Recompute
share = recomputed / prefill tokens.

Times: a batch's ``time`` is the end of its step; its start is ``time - step_time_s``. A
sequence added between steps arrives in the next batch, so its arrival is taken as that
step's start (the engine's own arrival is at most the idle gap before it).
"""

from __future__ import annotations

import bisect
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvscope.engine.events import schema as S
from kvscope.engine.events.analysis.lifecycle_records import (  # noqa: F401 (its names)
    ARRIVED,
    DECODE_CONTEXT_BIN,
    LEFT,
    PHASES,
    PREEMPTED,
    PREFILL,
    RECOMPUTED,
    RUNNING,
    STEP_COLUMNS,
    SWAPPED,
    WAITING,
    Phase,
    Preemption,
    PrefetchSpan,
    PrefixNode,
    SeqLife,
    classify_chunk,
)
from kvscope.engine.events.stats import StepStats


class LifecycleIndex:
    """Add batches in step order (``add``); read ``seqs``, ``steps``, ``evictions``,
    ``preemptions``, ``prefix``. Batches that would go backwards in step are ignored (a
    resync replay), so feeding a live subscriber's updates is safe."""

    def __init__(self) -> None:
        self.seqs: dict[str, SeqLife] = {}
        self.order: list[str] = []  # sequence ids by arrival (the Gantt's rows)
        self.block_size: dict[str, int] = {}
        self._cols: dict[str, list] = {c: [] for c in STEP_COLUMNS}
        self._arrays: dict[str, np.ndarray] | None = None
        self.preemptions: list[tuple[str, Preemption]] = []
        self.evictions: list[dict[str, Any]] = []  # {step, time, tier, blocks, cause}
        self.prefix: dict[int, PrefixNode] = {}
        self.block_hash: dict[str, dict[int, int]] = {t: {} for t in S.TIERS}
        self.hash_block: dict[str, dict[int, int]] = {t: {} for t in S.TIERS}
        self.decode_bins: dict[int, list[float]] = {}  # bin -> [sum step time, count]
        self.last_step = -1
        self.totals = {"prefill_tokens": 0, "recomputed_tokens": 0, "decode_tokens": 0}
        self._live = {"waiting": 0, "running": 0, "swapped": 0}
        self._alive: dict[str, SeqLife] = {}  # unfinished sequences (few next to all)
        self._holders: dict[str, SeqLife] = {}  # sequences holding blocks now

    # ----------------------------------------------------------------- build
    @classmethod
    def from_batches(cls, batches: Iterable[dict[str, Any]]) -> LifecycleIndex:
        idx = cls()
        for b in batches:
            idx.add(b)
        return idx

    @classmethod
    def for_recording(cls, rec: Any) -> LifecycleIndex:
        """The index of a whole Recording, computed once per Recording object."""
        idx = _CACHE.get(rec)
        if idx is None:
            idx = cls.from_batches(rec.batches())
            _CACHE[rec] = idx
        return idx

    def adopt(self, state: Any) -> int:
        """Take in the sequences of a KVState the index has not seen (a live view that
        joined a running engine): each starts at ``state.step`` in the phase its status
        implies, its earlier history unknown (no TTFT). Returns how many were adopted."""
        self._step, self._t0, self._t_end = int(state.step), float(state.time), float(
            state.time)
        n = 0
        for sid, q in state.seqs.items():
            if sid in self.seqs:
                continue
            s = SeqLife(sid, int(q.prompt_tokens), int(q.priority), q.parent, self._step,
                        self._t0)
            s.tokens = s.high_water = int(q.num_tokens)
            s.tier, s.status = q.tier, q.status
            s.num_blocks = len(q.block_table)
            if s.num_blocks:
                s.blocks.append((self._step, s.num_blocks))
            s.hit_tokens = int(getattr(q, "hit_tokens", 0))
            self.seqs[sid] = self._alive[sid] = s
            self.order.append(sid)
            self._live[q.status] = self._live.get(q.status, 0) + 1
            kind = {"swapped": SWAPPED, "waiting": PREEMPTED if q.preemptions else WAITING}.get(
                q.status, PREFILL if q.num_tokens < q.prompt_tokens else RUNNING)
            s.phases.append(Phase(kind, self._step, self._t0, detail="joined here"))
            n += 1
        self.last_step = max(self.last_step, self._step)  # the state already holds these
        return n

    @staticmethod
    def remember(rec: Any, idx: LifecycleIndex) -> None:
        """Cache an index built elsewhere (e.g. on a worker thread) for ``rec``."""
        _CACHE[rec] = idx

    def add(self, batch: dict[str, Any]) -> None:
        step = int(batch.get("step", self.last_step + 1))
        if step <= self.last_step:
            return
        stats = StepStats.read(batch.get("stats"))
        t_end = float(batch.get("time", 0.0))
        dt = float(stats.step_time_s or 0.0)
        t0 = t_end - dt
        self._step, self._t0, self._t_end = step, t0, t_end
        self._row = dict.fromkeys(("prefill_tokens", "recomputed_tokens", "decode_tokens",
                                   "finished", "preemptions", "evicted_blocks",
                                   "swap_out_blocks", "swap_in_blocks"), 0)
        self._decode_ctx: list[int] = []
        self._freed_tokens: dict[str, int] = {}
        self._chain_tail: dict[str, int | None] = {}
        self._forked: set[str] = set()
        for ev in batch.get("events") or ():
            # a KV cache group other than 0 (the hybrid cache's window group): its blocks
            # are not the sequence's tokens or table, which group 0 tells
            if isinstance(ev, dict) and not ev.get("group"):
                fn = _HANDLERS.get(ev.get("kind"))
                if fn is not None:
                    try:
                        fn(self, ev)
                    except (KeyError, TypeError, ValueError, IndexError):
                        pass  # a malformed event: KVState.apply reports it; skip it here
        for ctx in self._decode_ctx:
            acc = self.decode_bins.setdefault(ctx // DECODE_CONTEXT_BIN, [0.0, 0])
            acc[0] += dt
            acc[1] += 1
        self._close_row(step, t_end, dt, stats)
        self.last_step = step

    def _close_row(self, step: int, t_end: float, dt: float, stats: StepStats) -> None:
        r = self._row
        gpu, cpu = stats.tier("gpu"), stats.tier("cpu")
        used, bs = gpu.used, self.block_size.get("gpu", 1)
        if stats.used_tokens is not None and used is not None:
            toks, slots = stats.used_tokens, used * bs  # the engine's (shared blocks once)
        else:  # from events alone: per sequence, shared blocks counted per holder
            gpu_seqs = [s for s in self._holders.values() if s.tier == "gpu"]
            slots = sum(s.num_blocks for s in gpu_seqs) * bs
            toks = sum(s.tokens for s in gpu_seqs)
        row = {
            "step": step, "time": t_end, "step_time": dt,
            "running": _given(stats.running, self._live["running"]),
            "waiting": _given(stats.waiting, self._live["waiting"]),
            "swapped": _given(stats.swapped, self._live["swapped"]),
            "gpu_used": _given(gpu.used_blocks(), -1),
            "cpu_used": _given(cpu.used_blocks(), -1),
            "gpu_total": _given(gpu.total, -1), "cpu_total": _given(cpu.total, -1),
            "hit_tokens": _given(stats.hit_tokens, -1),
            "query_tokens": _given(stats.query_tokens, -1),
            "occupied_tokens": toks, "occupied_slots": slots,
            "decode_context_tokens": sum(self._decode_ctx), **r,
        }
        for c in STEP_COLUMNS:
            self._cols[c].append(row[c])
        for k in self.totals:
            self.totals[k] += r[k]
        self._arrays = None

    # ----------------------------------------------------------------- read
    @property
    def steps(self) -> dict[str, np.ndarray]:
        """Per-step columns (STEP_COLUMNS) as numpy arrays, one entry per batch."""
        if self._arrays is None:
            self._arrays = {c: np.asarray(v, dtype=np.float64 if c in ("time", "step_time")
                                          else np.int64) for c, v in self._cols.items()}
        return self._arrays

    def row_of_step(self, step: int) -> int:
        """Index of the last batch with a step <= ``step`` (-1 before the first)."""
        return bisect.bisect_right(self._cols["step"], step) - 1

    @property
    def recompute_share(self) -> float:
        p = self.totals["prefill_tokens"]
        return self.totals["recomputed_tokens"] / p if p else 0.0

    def decode_time_by_context(self) -> list[tuple[int, int, float, int]]:
        """[(context from, context to, mean step time of decode steps (s), decode tokens)]
        by context length bins: latency creep as contexts grow."""
        return [(b * DECODE_CONTEXT_BIN, (b + 1) * DECODE_CONTEXT_BIN, s / n, n)
                for b, (s, n) in sorted(self.decode_bins.items()) if n]

    def prefix_nodes(self) -> list[PrefixNode]:
        """Prefix-tree nodes, most tokens saved first."""
        return sorted(self.prefix.values(), key=lambda n: (-n.tokens_saved, n.depth))

    def prefix_subtree(self, node_hash: int) -> set[int]:
        """The hashes of a node and of every node below it."""
        out, todo = set(), [node_hash]
        while todo:
            h = todo.pop()
            if h not in out:
                out.add(h)
                node = self.prefix.get(h)
                if node is not None:
                    todo.extend(node.children)
        return out

    def prefix_blocks(self, node_hash: int) -> dict[str, list[int]]:
        """Where a node and its descendants live now: {tier: block ids}."""
        out: dict[str, list[int]] = {t: [] for t in S.TIERS}
        todo = [node_hash]
        while todo:
            h = todo.pop()
            for t in S.TIERS:
                b = self.hash_block[t].get(h)
                if b is not None:
                    out[t].append(b)
            node = self.prefix.get(h)
            if node is not None:
                todo.extend(node.children)
        return out

    # ------------------------------------------------------------- helpers
    def _enter(self, s: SeqLife, kind: str, detail: str = "") -> None:
        last = s.phases[-1] if s.phases else None
        if last is not None and last.kind == kind and not detail:
            return
        if last is not None and last.start_step == self._step and last.kind == WAITING:
            s.phases.pop()  # added and scheduled in one step: it never waited a step
        self._close_phase(s)
        s.phases.append(Phase(kind, self._step, self._t0, detail=detail))

    def _close_phase(self, s: SeqLife) -> None:
        if s.phases and s.phases[-1].end_step is None:
            s.phases[-1].end_step, s.phases[-1].end_time = self._step, self._t0

    def _set_blocks(self, s: SeqLife, n: int) -> None:
        s.num_blocks = n
        if n:
            self._holders[s.seq_id] = s
        else:
            self._holders.pop(s.seq_id, None)
        if s.blocks and s.blocks[-1][0] == self._step:
            s.blocks[-1] = (self._step, n)
        else:
            s.blocks.append((self._step, n))

    def _computed(self, s: SeqLife, a: int, b: int) -> None:
        """The sequence computed positions [a, b) this step."""
        if b <= a:
            return
        pre, redo = classify_chunk(a, b, s.prompt_tokens, s.high_water)
        if pre:
            s.prefill_tokens += pre
            s.recomputed_tokens += redo
            self._row["prefill_tokens"] += pre
            self._row["recomputed_tokens"] += redo
            self._enter(s, PREFILL)
        else:
            self._row["decode_tokens"] += 1
            self._decode_ctx.append(b)
            self._enter(s, RUNNING)
        s.high_water = max(s.high_water, b)
        if s.first_token_step is None and b >= s.prompt_tokens:
            s.first_token_step, s.first_token_time = self._step, self._t_end

    def _status(self, s: SeqLife, old: str | None, new: str | None) -> None:
        if old:
            self._live[old] -= 1
        if new:
            self._live[new] += 1

    # ------------------------------------------------------------ handlers
    def _tier_init(self, ev: dict[str, Any]) -> None:
        t = ev["tier"]
        self.block_size[t] = int(ev["block_size"])
        self.block_hash[t], self.hash_block[t] = {}, {}

    def _seq_add(self, ev: dict[str, Any]) -> None:
        sid = ev["seq"]
        s = SeqLife(sid, int(ev.get("prompt_tokens", 0)), int(ev.get("priority", 0)),
                    ev.get("parent"), self._step, self._t0)
        if sid not in self.seqs:
            self.order.append(sid)
        self.seqs[sid] = s
        self._alive[sid] = s
        self._status(s, None, "waiting")
        self._enter(s, WAITING)

    def _seq_start(self, ev: dict[str, Any]) -> None:
        s = self.seqs[ev["seq"]]
        self._status(s, s.status, "running")
        s.status = "running"
        self._end_prefetch(s, None)

    def _end_prefetch(self, s: SeqLife, outcome: str | None) -> None:
        """The sequence stopped waiting: its open prefetch ends now (``outcome`` None:
        by what arrived)."""
        pf = s.prefetches[-1] if s.prefetches else None
        if pf is None or pf.outcome is not None:
            return
        if outcome is None:
            outcome = ARRIVED if pf.arrived + pf.missed >= pf.blocks else RECOMPUTED
        pf.end_step, pf.end_time, pf.outcome = self._step, self._t0, outcome

    def _prefetch(self, ev: dict[str, Any]) -> None:
        s = self.seqs[ev["seq"]]
        self._end_prefetch(s, None)
        s.prefetches.append(PrefetchSpan(self._step, self._t0, len(_ids(ev["src"]))))

    def _disk_load(self, ev: dict[str, Any]) -> None:
        s = self.seqs.get(ev["seq"])
        if s is None or not s.prefetches:
            return
        pf = s.prefetches[-1]
        pf.arrived += len(_ids(ev["src"]))
        pf.missed += int(ev.get("missed", 0))
        if pf.outcome is None:  # late reads of a given-up prefetch still become host cache
            pf.arrive_step, pf.arrive_time = self._step, self._t0

    _seq_resume = _seq_start

    def _alloc(self, ev: dict[str, Any]) -> None:
        s = self.seqs[ev["seq"]]
        s.tier = ev["tier"]
        self._set_blocks(s, s.num_blocks + len(_ids(ev["blocks"])))

    def _hit(self, ev: dict[str, Any]) -> None:
        s = self.seqs[ev["seq"]]
        blocks, tokens = _ids(ev["blocks"]), int(ev.get("tokens", 0))
        s.tier = ev["tier"]
        self._set_blocks(s, s.num_blocks + len(blocks))
        s.tokens += tokens
        s.hit_tokens += tokens
        s.hits.append((self._step, s.hit_tokens))
        self._chain(s, ev["tier"], blocks, tokens, start=True)

    def _host_hit(self, ev: dict[str, Any]) -> None:
        s = self.seqs[ev["seq"]]
        src, dst, tokens = _ids(ev["src"]), _ids(ev["dst"]), int(ev.get("tokens", 0))
        self._set_blocks(s, s.num_blocks + len(dst))
        s.tokens += tokens
        s.hit_tokens += tokens
        s.hits.append((self._step, s.hit_tokens))
        self._chain(s, "cpu", src, tokens, start=s.seq_id not in self._chain_tail)
        gh, gb = self.block_hash["gpu"], self.hash_block["gpu"]
        for a, b in zip(src, dst, strict=False):
            h = self.block_hash["cpu"].get(a)
            if h is not None:
                gh[b], gb[h] = h, b

    def _chain(self, s: SeqLife, tier: str, blocks: list[int], tokens: int,
               start: bool) -> None:
        """Credit each hit block's prefix node (its parent is the block before it)."""
        if not blocks:
            return
        per_block = tokens // len(blocks)
        parent = None if start else self._chain_tail.get(s.seq_id)
        hashes = self.block_hash[tier]
        for b in blocks:
            h = hashes.get(b)
            if h is None:
                break
            node = self.prefix.get(h)
            if node is None:
                depth = 0 if parent is None else self.prefix[parent].depth + 1
                node = self.prefix[h] = PrefixNode(h, parent, depth, self._step)
                if parent is not None:
                    self.prefix[parent].children.add(h)
            node.hits += 1
            node.tokens_saved += per_block
            node.last_hit_step = self._step
            node.seqs.add(s.seq_id)
            parent = h
        self._chain_tail[s.seq_id] = parent

    def _store(self, ev: dict[str, Any]) -> None:
        t = ev["tier"]
        bh, hb = self.block_hash[t], self.hash_block[t]
        for b, h in zip(_ids(ev["blocks"]), ev["hashes"], strict=False):
            bh[int(b)], hb[int(h)] = int(h), int(b)

    def _offload(self, ev: dict[str, Any]) -> None:
        bh, hb = self.block_hash["cpu"], self.hash_block["cpu"]
        for b, h in zip(_ids(ev["dst"]), ev["hashes"], strict=False):
            bh[int(b)], hb[int(h)] = int(h), int(b)

    def _evict(self, ev: dict[str, Any]) -> None:
        t, blocks = ev["tier"], _ids(ev["blocks"])
        bh, hb = self.block_hash[t], self.hash_block[t]
        for b in blocks:
            h = bh.pop(b, None)
            if h is not None and hb.get(h) == b:
                del hb[h]
        self._row["evicted_blocks"] += len(blocks)
        cause = ev.get("cause")
        self.evictions.append({"step": self._step, "time": self._t_end, "tier": t,
                               "blocks": len(blocks),
                               "cause": cause if isinstance(cause, dict) else None})

    def _free(self, ev: dict[str, Any]) -> None:
        s = self.seqs[ev["seq"]]
        self._freed_tokens[s.seq_id] = s.tokens
        s.tokens = 0
        self._set_blocks(s, 0)
        self._chain_tail.pop(s.seq_id, None)

    def _fork(self, ev: dict[str, Any]) -> None:
        s, p = self.seqs[ev["seq"]], self.seqs[ev["parent"]]
        s.tier = ev["tier"]
        s.tokens = p.tokens
        self._set_blocks(s, len(_ids(ev["blocks"])))
        # A child is forked when its parent samples its first token, and shares that
        # sample: its first token is this step's, and this step's count for it (in
        # seq_tokens) is the parent's work, not its own.
        s.first_token_step, s.first_token_time = self._step, self._t_end
        self._forked.add(s.seq_id)
        self._enter(s, RUNNING)

    def _seq_tokens(self, ev: dict[str, Any]) -> None:
        seqs = self.seqs
        for sid, n in zip(ev["seqs"], ev["num_tokens"], strict=False):
            s = seqs.get(sid)
            if s is None:  # added before a live index started: nothing to account
                continue
            n = int(n)
            a = s.tokens
            if n == a + 1 and a >= s.high_water and a >= s.prompt_tokens and s.phases \
                    and s.phases[-1].kind == RUNNING and sid not in self._forked:
                # the common case, a decode step of a running sequence, inlined
                self._row["decode_tokens"] += 1
                self._decode_ctx.append(n)
                s.high_water = n
            elif sid not in self._forked:
                self._computed(s, a, n)
            s.tokens = n

    def _seq_preempt(self, ev: dict[str, Any]) -> None:
        s = self.seqs[ev["seq"]]
        mode = ev["mode"]
        cause = ev.get("cause") if isinstance(ev.get("cause"), dict) else None
        p = Preemption(self._step, self._t0, mode, cause)
        s.preemptions.append(p)
        self.preemptions.append((s.seq_id, p))
        self._row["preemptions"] += 1
        from kvscope.engine.events.causes import describe

        new = "swapped" if mode == "swap" else "waiting"
        self._status(s, s.status, new)
        s.status = new
        self._enter(s, SWAPPED if mode == "swap" else PREEMPTED,
                    detail=describe(cause, victim=s.seq_id))

    def _move(self, ev: dict[str, Any], tier: str, key: str) -> None:
        s = self.seqs[ev["seq"]]
        s.tier = tier
        self._row[key] += len(_ids(ev["src"]))

    def _swap_out(self, ev: dict[str, Any]) -> None:
        self._move(ev, "cpu", "swap_out_blocks")

    def _swap_in(self, ev: dict[str, Any]) -> None:
        self._move(ev, "gpu", "swap_in_blocks")

    def _seq_finish(self, ev: dict[str, Any]) -> None:
        sid = ev["seq"]
        s = self.seqs[sid]
        if "num_tokens" in ev:  # the chunk of its last step (no seq_tokens follows)
            a = self._freed_tokens.get(sid, s.tokens)
            self._computed(s, a, int(ev["num_tokens"]))
        if "output_tokens" in ev:
            s.output_tokens = int(ev["output_tokens"])
        else:
            s.output_tokens = max(0, s.high_water - s.prompt_tokens + 1) \
                if s.first_token_step is not None else 0
        self._close_phase(s)
        self._end_prefetch(s, LEFT)
        if s.phases:  # the last phase includes the finishing step
            s.phases[-1].end_step, s.phases[-1].end_time = self._step + 1, self._t_end
        s.finish_step, s.finish_time = self._step, self._t_end
        s.finish_reason = ev.get("reason")
        self._status(s, s.status, None)
        s.status = "finished"
        self._alive.pop(sid, None)
        self._row["finished"] += 1


_HANDLERS = {
    S.TIER_INIT: LifecycleIndex._tier_init, S.SEQ_ADD: LifecycleIndex._seq_add,
    S.SEQ_START: LifecycleIndex._seq_start, S.SEQ_RESUME: LifecycleIndex._seq_resume,
    S.ALLOC: LifecycleIndex._alloc, S.HIT: LifecycleIndex._hit,
    S.HOST_HIT: LifecycleIndex._host_hit, S.STORE: LifecycleIndex._store,
    S.OFFLOAD: LifecycleIndex._offload, S.EVICT: LifecycleIndex._evict,
    S.FREE: LifecycleIndex._free, S.FORK: LifecycleIndex._fork,
    S.SEQ_TOKENS: LifecycleIndex._seq_tokens, S.SEQ_PREEMPT: LifecycleIndex._seq_preempt,
    S.SWAP_OUT: LifecycleIndex._swap_out, S.SWAP_IN: LifecycleIndex._swap_in,
    S.SEQ_FINISH: LifecycleIndex._seq_finish, S.PREFETCH: LifecycleIndex._prefetch,
    S.DISK_LOAD: LifecycleIndex._disk_load,
}

def _given(value: int | None, default: int) -> int:
    """A reported stat, or ``default`` where the batch did not report it."""
    return default if value is None else value


def _ids(blocks: Any) -> list[int]:
    """Block ids as a list: a list, a numpy array, or protocol 2's packed little-endian
    int32 bytes."""
    if type(blocks) is list:
        return blocks
    if isinstance(blocks, (bytes, bytearray, memoryview)):
        return np.frombuffer(blocks, dtype="<i4").tolist()
    return blocks.tolist() if hasattr(blocks, "tolist") else list(blocks)


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
