"""A seeded generator of *valid* event sequences, for tests and benchmarks.

``SyntheticCache`` plays a tiny cache manager: it keeps its own bookkeeping (ref counts,
prefix hashes, free/evictable sets, sequences) and emits, into any EventSink, only
events that ``KVState.apply`` accepts: sequences arrive (some forked, some hitting the
prefix cache or the host tier), decode, fill and store blocks, copy-on-write shared
tails, get preempted (recompute or swap), resume and finish. Same seed, same events.

It is not the engine's cache manager (engine.cache is); it exists so the transport and
the recordings can be tested and measured without it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from kvscope.engine.events import schema as S
from kvscope.engine.events.sink import EventSink


@dataclass
class _Tier:
    num_blocks: int
    ref: list[int] = field(default_factory=list)
    hashes: dict[int, int] = field(default_factory=dict)
    free: set[int] = field(default_factory=set)  # ref 0, no hash
    evictable: dict[int, None] = field(default_factory=dict)  # ref 0, hashed (LRU order)

    def __post_init__(self) -> None:
        self.ref = [0] * self.num_blocks
        self.free = set(range(self.num_blocks))

    def _sync(self, b: int) -> None:
        """Recompute b's membership of free/evictable after its ref or hash changed."""
        self.free.discard(b)
        self.evictable.pop(b, None)
        if self.ref[b] == 0:
            if b in self.hashes:
                self.evictable[b] = None
            else:
                self.free.add(b)

    def add_ref(self, blocks: list[int], delta: int) -> None:
        for b in blocks:
            self.ref[b] += delta
            self._sync(b)

    def set_hash(self, b: int, h: int | None) -> None:
        if h is None:
            self.hashes.pop(b, None)
        else:
            self.hashes[b] = h
        self._sync(b)

    def take_free(self, n: int) -> list[int]:
        """n blocks that are ref 0 and unhashed (int sets iterate deterministically)."""
        out = list(islice(self.free, n))
        for b in out:
            self.free.discard(b)
        return out


@dataclass
class _Seq:
    sid: str
    status: str = "waiting"
    tier: str = "gpu"
    table: list[int] = field(default_factory=list)
    tokens: int = 0
    prompt: int = 0
    reported: int = 0  # num_tokens as the events have told it so far


class SyntheticCache:
    """Emits one step of valid events per ``step(sink)`` call.

    ``gpu_blocks``/``cpu_blocks`` size the tiers; ``max_running`` caps the batch. Larger
    values give larger batches (the benchmark uses ~256 running sequences).
    """

    def __init__(self, seed: int = 0, gpu_blocks: int = 128, cpu_blocks: int = 128,
                 block_size: int = 16, max_running: int = 8, arrival_rate: float = 0.6) -> None:
        self.rng = random.Random(seed)
        self.block_size = block_size
        self.max_running = max_running
        self.arrival_rate = arrival_rate
        self.tiers = {"gpu": _Tier(gpu_blocks), "cpu": _Tier(cpu_blocks)}
        self.seqs: dict[str, _Seq] = {}
        self.step_no = -1
        self._next_id = 0
        self._started = False

    # ------------------------------------------------------------------ helpers
    def _hash(self) -> int:
        return self.rng.getrandbits(62)

    def _alloc(self, sink: EventSink, s: _Seq, n: int) -> bool:
        gpu = self.tiers["gpu"]
        if len(gpu.free) < n:
            need = n - len(gpu.free)
            victims = list(islice(gpu.evictable, need))
            if len(victims) < need:
                return False
            for b in victims:
                gpu.set_hash(b, None)
            sink.emit(S.EVICT, tier="gpu", blocks=victims)
        blocks = gpu.take_free(n)
        gpu.add_ref(blocks, +1)
        s.table.extend(blocks)
        s.tier = "gpu"
        sink.emit(S.ALLOC, tier="gpu", seq=s.sid, blocks=blocks)
        return True

    def _free_table(self, sink: EventSink, s: _Seq) -> None:
        if s.table:
            self.tiers[s.tier].add_ref(s.table, -1)
            sink.emit(S.FREE, tier=s.tier, seq=s.sid, blocks=list(s.table))
            s.table = []
        s.tokens = s.reported = 0  # "free" resets num_tokens

    def _capacity(self, s: _Seq) -> int:
        return len(s.table) * self.block_size

    # -------------------------------------------------------------- scheduling
    def _admit(self, sink: EventSink, s: _Seq) -> bool:
        """Give a waiting sequence (empty table) its prompt's blocks; start or resume it."""
        gpu, cpu, rng = self.tiers["gpu"], self.tiers["cpu"], self.rng
        need = max(1, -(-s.prompt // self.block_size))
        if len(gpu.free) + len(gpu.evictable) < need + 2:
            return False
        if not s.table:
            if gpu.hashes and rng.random() < 0.5:
                # probe a few random ids for cached blocks: O(1), unlike listing the cache
                probe = dict.fromkeys(rng.randrange(gpu.num_blocks) for _ in range(8))
                hits = [b for b in probe if b in gpu.hashes][: min(rng.randint(1, 3),
                                                                   need - 1 or 1)]
            else:
                hits = []
            if hits:
                gpu.add_ref(hits, +1)
                s.table.extend(hits)
                sink.emit(S.HIT, tier="gpu", seq=s.sid, blocks=hits,
                          tokens=len(hits) * self.block_size)
            room = need - len(s.table)
            if cpu.evictable and room > 1 and rng.random() < 0.5:
                src = list(islice(cpu.evictable, min(room - 1, 2)))
                dst = gpu.take_free(len(src))
                if len(dst) == len(src):
                    for a, b in zip(src, dst, strict=True):
                        gpu.hashes[b] = cpu.hashes[a]
                    gpu.add_ref(dst, +1)
                    s.table.extend(dst)
                    sink.emit(S.HOST_HIT, seq=s.sid, src=src, dst=dst,
                              tokens=len(src) * self.block_size)
                else:
                    gpu.free.update(dst)
            rest = need - len(s.table)
            if rest > 0 and not self._alloc(sink, s, rest):
                self._free_table(sink, s)
                return False
            s.tokens = s.prompt
        sink.emit(S.SEQ_START if s.status == "waiting" else S.SEQ_RESUME, seq=s.sid)
        s.status = "running"
        return True

    def _swap_in(self, sink: EventSink, s: _Seq) -> bool:
        gpu, cpu = self.tiers["gpu"], self.tiers["cpu"]
        if len(gpu.free) < len(s.table) + 2:
            return False
        dst = gpu.take_free(len(s.table))
        cpu.add_ref(s.table, -1)
        gpu.add_ref(dst, +1)
        sink.emit(S.SWAP_IN, seq=s.sid, src=list(s.table), dst=list(dst))
        s.table, s.tier, s.status = dst, "gpu", "running"
        sink.emit(S.SEQ_RESUME, seq=s.sid)
        return True

    def _preempt(self, sink: EventSink, s: _Seq) -> None:
        cpu = self.tiers["cpu"]
        if self.rng.random() < 0.5 and len(cpu.free) >= len(s.table):
            dst = cpu.take_free(len(s.table))
            self.tiers["gpu"].add_ref(s.table, -1)
            cpu.add_ref(dst, +1)
            sink.emit(S.SWAP_OUT, seq=s.sid, src=list(s.table), dst=list(dst))
            s.table, s.tier, s.status = dst, "cpu", "swapped"
            sink.emit(S.SEQ_PREEMPT, seq=s.sid, mode="swap")
        else:
            self._free_table(sink, s)
            s.status = "preempted"  # waiting again, will be resumed (not started)
            sink.emit(S.SEQ_PREEMPT, seq=s.sid, mode="recompute")

    def _decode(self, sink: EventSink, s: _Seq) -> bool:
        """One token for s: COW a shared tail, grow the table, store a filled block."""
        gpu = self.tiers["gpu"]
        last = len(s.table) - 1
        if s.tokens < self._capacity(s) and gpu.ref[s.table[last]] > 1:
            if not gpu.free:
                return False
            (dst,) = gpu.take_free(1)
            src = s.table[last]
            gpu.add_ref([src], -1)
            gpu.add_ref([dst], +1)
            s.table[last] = dst
            sink.emit(S.COW, tier="gpu", seq=s.sid, logical=[last], src=[src], dst=[dst])
        if s.tokens >= self._capacity(s) and not self._alloc(sink, s, 1):
            return False
        s.tokens += 1
        if s.tokens % self.block_size == 0:
            b = s.table[s.tokens // self.block_size - 1]
            if b not in gpu.hashes:
                gpu.set_hash(b, self._hash())
                sink.emit(S.STORE, tier="gpu", blocks=[b], hashes=[gpu.hashes[b]])
        return True

    def _offload(self, sink: EventSink) -> None:
        gpu, cpu = self.tiers["gpu"], self.tiers["cpu"]
        src = list(islice(gpu.evictable, 2))
        if not src:
            return
        if len(cpu.free) < len(src):
            victims = list(islice(cpu.evictable, len(src) - len(cpu.free)))
            if len(victims) < len(src) - len(cpu.free):
                return
            for b in victims:
                cpu.set_hash(b, None)
            sink.emit(S.EVICT, tier="cpu", blocks=victims)
        dst = cpu.take_free(len(src))
        hashes = [gpu.hashes[b] for b in src]
        for b, h in zip(dst, hashes, strict=True):
            cpu.set_hash(b, h)
        sink.emit(S.OFFLOAD, src=src, dst=dst, hashes=hashes)

    # --------------------------------------------------------------------- step
    def step(self, sink: EventSink) -> dict[str, Any]:
        """Emit one engine step's events into ``sink``; return the step's stats."""
        rng = self.rng
        self.step_no += 1
        if not self._started:
            self._started = True
            for name, t in self.tiers.items():
                sink.emit(S.TIER_INIT, tier=name, num_blocks=t.num_blocks,
                          block_size=self.block_size, format="auto")
        # arrivals (some forks of a running sequence)
        while rng.random() < self.arrival_rate and len(self.seqs) < 4 * self.max_running:
            sid = f"s{self._next_id}"
            self._next_id += 1
            running = [s for s in self.seqs.values() if s.status == "running"]
            parent = rng.choice(running) if running and rng.random() < 0.2 else None
            s = _Seq(sid, prompt=rng.randint(1, 6 * self.block_size))
            self.seqs[sid] = s
            sink.emit(S.SEQ_ADD, seq=sid, prompt_tokens=s.prompt,
                      parent=parent.sid if parent else None)
            if parent is not None:
                self.tiers["gpu"].add_ref(parent.table, +1)
                s.table, s.tokens, s.prompt = list(parent.table), parent.tokens, parent.tokens
                s.reported = parent.reported  # "fork" copies the parent's num_tokens
                sink.emit(S.FORK, tier="gpu", seq=sid, parent=parent.sid,
                          blocks=list(parent.table))
        # schedule: swapped first, then waiting, up to max_running
        running = sum(s.status == "running" for s in self.seqs.values())
        for s in list(self.seqs.values()):
            if running >= self.max_running:
                break
            if s.status == "swapped" and self._swap_in(sink, s):
                running += 1
            elif s.status in ("waiting", "preempted") and self._admit(sink, s):
                running += 1
        # decode; finish or preempt some
        decoded = 0
        for s in list(self.seqs.values()):
            if s.status != "running":
                continue
            r = rng.random()
            if r < 0.04:
                self._free_table(sink, s)
                del self.seqs[s.sid]
                sink.emit(S.SEQ_FINISH, seq=s.sid, reason=rng.choice(["stop", "length"]))
            elif r < 0.07 or not self._decode(sink, s):
                self._preempt(sink, s)
            else:
                decoded += 1
        changed = [s for s in self.seqs.values() if s.tokens != s.reported]
        for s in changed:
            s.reported = s.tokens
        if changed:
            sink.emit(S.SEQ_TOKENS, seqs=[s.sid for s in changed],
                      num_tokens=[s.tokens for s in changed])
        if rng.random() < 0.2:
            self._offload(sink)
        gpu = self.tiers["gpu"]
        return {
            "running": sum(s.status == "running" for s in self.seqs.values()),
            "waiting": sum(s.status in ("waiting", "preempted") for s in self.seqs.values()),
            "swapped": sum(s.status == "swapped" for s in self.seqs.values()),
            "scheduled_tokens": decoded,
            "tiers": {"gpu": {"total": gpu.num_blocks, "free": len(gpu.free),
                              "cached": len(gpu.evictable)}},
        }

    def canonical(self) -> dict[str, Any]:
        """Ground truth in ``KVState.canonical()`` form (tier formats "auto")."""
        return {
            "tiers": {
                name: {"num_blocks": t.num_blocks, "block_size": self.block_size,
                       "format": "auto", "ref": list(t.ref),
                       "hash": [t.hashes.get(b) for b in range(t.num_blocks)],
                       "block_formats": {}}
                for name, t in sorted(self.tiers.items())
            },
            "seqs": {
                s.sid: {"status": "waiting" if s.status == "preempted" else s.status,
                        "tier": s.tier, "block_table": list(s.table), "num_tokens": s.tokens}
                for s in sorted(self.seqs.values(), key=lambda s: s.sid)
            },
        }
