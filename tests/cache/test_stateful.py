"""Hypothesis stateful test: random add/match/allocate/append/decode/fork/free/preempt/
finish/evict sequences on pools of 1..5000 blocks of 1..64 tokens.

After every step: ``check_invariants()``, and the KVState rebuilt from the step's events
equals ``snapshot()``. A simulated runner also writes every slot it is given (the digest
of the token prefix ending at that position) and performs the copy orders, so the test
proves what the cache is for: every position of every sequence reads back the KV of
exactly its own prefix, through prefix hits, copy-on-write, eviction and preemption.
"""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvscope.engine.cache import CacheError
from tests.cache.conftest import Mirrored

_rng = random.Random(1234)
BASES = [[_rng.randrange(8) for _ in range(400)] for _ in range(3)]  # shared prefixes


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.x: Mirrored | None = None
        self.kv: dict[int, int] = {}  # slot -> digest written by the simulated runner
        self.digests: dict[str, list[int]] = {}  # seq -> digest of each prefix
        self.counter = 0

    @initialize(
        block_size=st.one_of(st.integers(1, 4), st.integers(1, 64)),
        num_blocks=st.one_of(st.integers(1, 12), st.integers(1, 64), st.integers(1, 5000)),
        policy=st.sampled_from(["lru", "lfu", "priority"]),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, block_size: int, num_blocks: int, policy: str, caching: bool) -> None:
        self.x = Mirrored(num_blocks, block_size, eviction_policy=policy,
                          enable_prefix_caching=caching)
        self.bs = block_size
        for base in (0, 1):  # two running requests to start from
            self.admit(base, 3 * block_size + 1, [], 0, None)

    # ---------------------------------------------------------------- helpers
    @property
    def m(self):
        return self.x.m

    def seqs(self) -> list[str]:
        return sorted(self.digests)

    def _digest(self, sid: str) -> None:
        """Extend the prefix digests to cover the sequence's known token ids."""
        d, toks = self.digests[sid], self.m.token_ids(sid)
        for t in toks[len(d):]:
            d.append(hash((d[-1] if d else 0, t)))

    def _write(self, sid: str, start: int, end: int) -> None:
        """The runner computes positions [start, end) whose ids are known."""
        table, d, bs = self.m.block_table(sid), self.digests[sid], self.bs
        for p in range(start, min(end, len(d))):
            self.kv[table[p // bs] * bs + p % bs] = d[p]

    def _run_copies(self) -> None:
        orders = self.m.take_copy_orders()
        if orders:
            event("copy-on-write")
        for src, dst in orders:
            for o in range(self.bs):
                if src * self.bs + o in self.kv:
                    self.kv[dst * self.bs + o] = self.kv[src * self.bs + o]
                else:
                    self.kv.pop(dst * self.bs + o, None)

    def _allocate(self, sid: str, n: int) -> None:
        before = self.m.num_tokens(sid)
        can = self.m.can_allocate(sid, n)
        slots = self.m.allocate_slots(sid, n)
        assert (slots is not None) == can
        if slots is None:
            return
        assert len(slots) == n and self.m.num_tokens(sid) == before + n
        table, bs = self.m.block_table(sid), self.bs
        for p, s in zip(range(before, before + n), slots, strict=True):
            assert s == table[p // bs] * bs + p % bs
        self._run_copies()
        self._write(sid, before, before + n)

    # ------------------------------------------------------------------ rules
    @rule(base=st.integers(0, 2), cut=st.integers(0, 400), extra=st.lists(st.integers(0, 7),
          max_size=20), priority=st.integers(-1, 2), salt=st.sampled_from([None, None, "t"]))
    def add(self, base: int, cut: int, extra: list[int], priority: int, salt: str | None):
        prompt = (BASES[base][: cut % (4 * self.bs + 3)] + extra) or [1]
        sid = f"s{self.counter}"
        self.counter += 1
        self.m.add_sequence(sid, prompt, priority=priority, cache_salt=salt)
        self.digests[sid] = []
        self._digest(sid)

    @rule(base=st.integers(0, 2), cut=st.integers(0, 400), extra=st.lists(st.integers(0, 7),
          max_size=5), priority=st.integers(-1, 2), salt=st.sampled_from([None, None, "t"]))
    def admit(self, base: int, cut: int, extra: list[int], priority: int, salt: str | None):
        """The scheduler's admission of a new request (see ``_admit``)."""
        self.add(base, cut, extra, priority, salt)
        self._admit(f"s{self.counter - 1}")

    def _admit(self, sid: str) -> None:
        """Share the cached prefix, allocate the rest and run; or, when the pool is short,
        give the shared prefix back."""
        hit = self.m.match_prefix(sid)
        event("prefix hit" if hit else "prefix miss")
        rest = len(self.digests[sid]) - hit
        if self.m.can_allocate(sid, rest):
            self._allocate(sid, rest)
            self.m.start(sid)
        else:
            self.m.free(sid)

    @precondition(lambda self: self.digests)
    @rule(data=st.data(), blocks=st.one_of(st.none(), st.integers(1, 6)))
    def add_copy(self, data, blocks: int | None):
        """A new request repeating a known one (whole, or cut at a block boundary)."""
        src = data.draw(st.sampled_from(self.seqs()))
        prompt = self.m.token_ids(src)
        if blocks is not None:
            prompt = prompt[: blocks * self.bs] or prompt
        sid = f"s{self.counter}"
        self.counter += 1
        self.m.add_sequence(sid, prompt, cache_salt=self.m.sequences[src].cache_salt)
        self.digests[sid] = []
        self._digest(sid)
        if data.draw(st.booleans()):
            self._admit(sid)

    @precondition(lambda self: self.digests)
    @rule(data=st.data())
    def match(self, data):
        sid = data.draw(st.sampled_from(self.seqs()))
        if self.m.block_table(sid):
            with pytest.raises(CacheError):
                self.m.match_prefix(sid)
            return
        hit = self.m.match_prefix(sid)
        event("prefix hit" if hit else "prefix miss")
        assert 0 <= hit < len(self.digests[sid]) and hit % self.bs == 0
        assert self.m.num_tokens(sid) == hit

    @precondition(lambda self: self.digests)
    @rule(data=st.data(), n=st.integers(0, 70))
    def allocate(self, data, n: int):
        """Prefill-style: up to the known tokens (the usual case)."""
        sid = data.draw(st.sampled_from(self.seqs()))
        n = min(n, max(0, len(self.digests[sid]) - self.m.num_tokens(sid)))
        self._allocate(sid, n)

    @precondition(lambda self: self.digests)
    @rule(data=st.data(), n=st.integers(1, 5))
    def allocate_ahead(self, data, n: int):
        """Lookahead slots, whose ids arrive later."""
        self._allocate(data.draw(st.sampled_from(self.seqs())), n)

    @precondition(lambda self: self.digests)
    @rule(data=st.data(), ids=st.lists(st.integers(0, 7), min_size=1, max_size=4))
    def append(self, data, ids: list[int]):
        self._append(data.draw(st.sampled_from(self.seqs())), ids)

    def _append(self, sid: str, ids: list[int]) -> None:
        known = len(self.digests[sid])
        self.m.append_token_ids(sid, ids)
        self._digest(sid)
        self._write(sid, known, self.m.num_tokens(sid))  # lookahead slots get computed now

    @precondition(lambda self: self.digests)
    @rule(data=st.data(), tok=st.integers(0, 7), steps=st.integers(1, 8))
    def decode(self, data, tok: int, steps: int):
        """The decode loop: the sampled token is appended, next step it gets its slot."""
        sid = data.draw(st.sampled_from(self.seqs()))
        for _ in range(steps):
            if self.m.num_tokens(sid) >= len(self.digests[sid]):
                self._append(sid, [tok])
            self._allocate(sid, 1)

    @precondition(lambda self: self.digests)
    @rule(data=st.data())
    def fork(self, data):
        forked = self._fork(data.draw(st.sampled_from(self.seqs())))
        if forked is None:
            return
        child, table, private = forked
        shared = len(table) - private
        assert self.m.block_table(child)[:shared] == table[:shared]
        assert not set(self.m.block_table(child)[shared:]) & set(table)
        if private:
            event("fork with lookahead slots")

    def _fork(self, parent: str) -> tuple[str, list[int], int] | None:
        """Fork ``parent``, or check that the pool refuses it (None): (child, the parent's
        table, how many of its blocks the child gets privately for lookahead slots)."""
        child = f"s{self.counter}"
        self.counter += 1
        known, table = len(self.digests[parent]), self.m.block_table(parent)
        private = len(table) - known // self.bs if self.m.num_tokens(parent) > known else 0
        if private > self.m.num_free_blocks:
            with pytest.raises(CacheError):
                self.m.fork(parent, child)
            return None
        self.m.fork(parent, child)
        self._run_copies()
        self.digests[child] = list(self.digests[parent])
        return child, table, private

    @precondition(lambda self: self.digests)
    @rule(data=st.data())
    def free(self, data):
        self.m.free(data.draw(st.sampled_from(self.seqs())))

    @precondition(lambda self: self.digests)
    @rule(data=st.data())
    def start_or_resume(self, data):
        self._start_or_resume(data.draw(st.sampled_from(self.seqs())))

    def _start_or_resume(self, sid: str) -> None:
        seq = self.m.sequences[sid]
        if seq.status == "running":
            with pytest.raises(CacheError):
                self.m.resume(sid)
        elif seq.started:
            self.m.resume(sid)
        else:
            self.m.start(sid)
        assert self.m.status(sid) == "running"

    @precondition(lambda self: self.digests)
    @rule(data=st.data())
    def preempt(self, data):
        sid = data.draw(st.sampled_from(self.seqs()))
        if self.m.status(sid) != "running":
            with pytest.raises(CacheError):
                self.m.preempt(sid)
            return
        self.m.preempt(sid)
        assert self.m.num_tokens(sid) == 0 and self.m.status(sid) == "waiting"

    @precondition(lambda self: self.digests)
    @rule(data=st.data(), reason=st.sampled_from(["stop", "length", "abort"]))
    def finish(self, data, reason: str):
        sid = data.draw(st.sampled_from(self.seqs()))
        self.m.finish(sid, reason)
        del self.digests[sid]
        with pytest.raises(CacheError):
            self.m.append_token_ids(sid, [1])

    @rule(n=st.one_of(st.none(), st.integers(0, 10)))
    def evict(self, n: int | None):
        cached = self.m.metrics()["tiers"]["gpu"]["cached"]
        assert self.m.evict_cached(n) == (cached if n is None else min(n, cached))

    @rule(n=st.integers(-3, -1))
    def bad_count(self, n: int):
        if self.digests:
            with pytest.raises(CacheError):
                self.m.allocate_slots(self.seqs()[0], n)

    # ------------------------------------------------------------- invariants
    @invariant()
    def mirror_equals_manager_and_kv_reads_back(self):
        if self.x is None:
            return
        if "evict" in [e["kind"] for e in self.x.sync()]:  # invariants + mirror == snapshot
            event("eviction")
        bs = self.bs
        for sid, d in self.digests.items():
            table = self.m.block_table(sid)
            for p in range(min(self.m.num_tokens(sid), len(d))):
                assert self.kv.get(table[p // bs] * bs + p % bs) == d[p], (sid, p)


CacheMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestCacheMachine = CacheMachine.TestCase
