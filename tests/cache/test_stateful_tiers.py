"""Hypothesis stateful test of the two-tier cache: the rules of test_stateful plus swap-out
preemption (with its recompute fallback), swap-in, and, through every eviction and prefix
match, the host tier's write-back (offload) and host hits.

The simulated runner keeps a KV store per tier and executes the manager's swap rounds
(engine.cache.transfers: batched gather-then-scatter, as the real runner does) before
copy-on-write orders and before it "computes" any slot; otherwise orders pile up over
several rules, as they do over an engine step, so the rounds see interleaved orders.
After every step: invariants, the
event mirror equals the snapshot, and every position of every sequence, on either tier,
reads back the digest of exactly its own prefix.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import initialize, invariant, precondition, rule

from kvscope.engine.cache import CacheError
from tests.cache.conftest import Mirrored
from tests.cache.test_stateful import CacheMachine


class TieredCacheMachine(CacheMachine):
    def __init__(self) -> None:
        super().__init__()
        self.host_kv: dict[int, int] = {}  # host slot -> digest

    @initialize(
        block_size=st.one_of(st.integers(1, 4), st.integers(1, 16)),
        num_blocks=st.one_of(st.integers(1, 12), st.integers(1, 64)),
        num_cpu_blocks=st.one_of(st.integers(1, 8), st.integers(1, 64)),
        policy=st.sampled_from(["lru", "lfu", "priority"]),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, block_size: int, num_blocks: int, num_cpu_blocks: int, policy: str,
              caching: bool) -> None:
        self.x = Mirrored(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks,
                          eviction_policy=policy, enable_prefix_caching=caching)
        self.bs = block_size
        for base in (0, 1):
            self.admit(base, 3 * block_size + 1, [], 0, None)

    # ------------------------------------------------------ simulated runner
    def _store(self, sid: str) -> dict[int, int]:
        return self.host_kv if self.m.sequences[sid].tier == "cpu" else self.kv

    def _run_copies(self) -> None:
        bs = self.bs
        for outs, ins in self.m.take_swap_rounds():
            for pairs, src_kv, dst_kv in ((outs, self.kv, self.host_kv),
                                          (ins, self.host_kv, self.kv)):
                if pairs:
                    event("swap copies")
                # a batch gathers every source block, then scatters
                gathered = [[src_kv.get(a * bs + o) for o in range(bs)] for a, _ in pairs]
                for (_, b), vals in zip(pairs, gathered, strict=True):
                    for o, v in enumerate(vals):
                        if v is None:
                            dst_kv.pop(b * bs + o, None)
                        else:
                            dst_kv[b * bs + o] = v
        super()._run_copies()

    def _write(self, sid: str, start: int, end: int) -> None:
        self._run_copies()  # pending copies land before any slot is computed
        table, d, bs, kv = self.m.block_table(sid), self.digests[sid], self.bs, self._store(sid)
        for p in range(start, min(end, len(d))):
            kv[table[p // bs] * bs + p % bs] = d[p]

    def _allocate(self, sid: str, n: int) -> None:
        if self.m.status(sid) == "swapped":
            with pytest.raises(CacheError):
                self.m.allocate_slots(sid, n)
            return
        super()._allocate(sid, n)

    def swapped(self, sid: str) -> bool:
        return self.m.status(sid) == "swapped"

    # ---------------------------------------------------------- swap rules
    @precondition(lambda self: self.digests)
    @rule(data=st.data())
    def swap_out(self, data):
        sid = data.draw(st.sampled_from(self.seqs()))
        if self.m.status(sid) != "running":
            with pytest.raises(CacheError):
                self.m.preempt(sid, "swap")
            return
        n, table = self.m.num_tokens(sid), self.m.block_table(sid)
        mode = self.m.preempt(sid, "swap")
        event(f"swap preemption by {mode}")
        if mode == "swap":
            assert self.swapped(sid) and self.m.num_tokens(sid) == n
            assert len(self.m.block_table(sid)) == len(table)
        else:
            assert self.m.status(sid) == "waiting" and self.m.num_tokens(sid) == 0

    @precondition(lambda self: self.digests)
    @rule(data=st.data(), n=st.integers(0, 3))
    def swap_in(self, data, n: int):
        swapped = [s for s in self.seqs() if self.swapped(s)]
        sid = data.draw(st.sampled_from(swapped or self.seqs()))
        if not self.swapped(sid):
            with pytest.raises(CacheError):
                self.m.swap_in(sid)
            return
        can = self.m.can_swap_in(sid, n)
        before = self.m.snapshot()
        if not self.m.swap_in(sid):
            assert not can and self.m.snapshot() == before
            event("swap-in refused")
            return
        event("swap-in")
        assert self.m.status(sid) == "running"
        if can:  # the room for n more tokens was promised too
            assert self.m.can_allocate(sid, n)
            self._allocate(sid, n)

    @precondition(lambda self: self.digests)
    @rule(data=st.data(), evict=st.one_of(st.none(), st.integers(0, 6)))
    def rerun_after_eviction(self, data, evict: int | None):
        """A finished request's prefix leaves the gpu (written back to the host), then a
        request with the same prompt arrives: the host tier serves what it kept."""
        src = data.draw(st.sampled_from(self.seqs()))
        prompt = self.m.token_ids(src)
        salt = self.m.sequences[src].cache_salt
        self.m.finish(src, "stop")
        del self.digests[src]
        self.m.evict_cached(evict)
        sid = f"s{self.counter}"
        self.counter += 1
        self.m.add_sequence(sid, prompt, cache_salt=salt)
        self.digests[sid] = []
        self._digest(sid)
        hosted = self.m.metrics()["host_hit_tokens"]
        self._admit(sid)
        if self.m.metrics()["host_hit_tokens"] > hosted:
            event("host hit after eviction")

    # ------------------------------------ base rules that a swapped seq changes
    @precondition(lambda self: self.digests)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(self.seqs()))
        if self.swapped(sid):
            with pytest.raises(CacheError):
                self.m.free(sid)
        else:
            self.m.free(sid)

    @precondition(lambda self: self.digests)
    @rule(data=st.data())
    def start_or_resume(self, data):
        sid = data.draw(st.sampled_from(self.seqs()))
        if self.swapped(sid):
            with pytest.raises(CacheError):
                self.m.resume(sid)
            return
        self._start_or_resume(sid)

    @precondition(lambda self: self.digests)
    @rule(data=st.data())
    def match(self, data):
        sid = data.draw(st.sampled_from(self.seqs()))
        if self.m.block_table(sid) or self.swapped(sid):
            with pytest.raises(CacheError):
                self.m.match_prefix(sid)
            return
        hosted = self.m.metrics()["host_hit_tokens"]
        hit = self.m.match_prefix(sid)
        if self.m.metrics()["host_hit_tokens"] > hosted:
            event("host hit")
        assert 0 <= hit < len(self.digests[sid]) and hit % self.bs == 0
        assert self.m.num_tokens(sid) == hit

    @precondition(lambda self: self.digests)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.seqs()))
        if self.swapped(parent):
            with pytest.raises(CacheError):
                self.m.fork(parent, "never")
            return
        self._fork(parent)

    @rule()
    def end_step(self):
        """The runner executes what the step queued."""
        if self.m.host.orders:
            event(f"{len(self.m.host.orders) // 4 * 4}+ orders in one step")
        self._run_copies()

    # ------------------------------------------------------------ invariants
    @invariant()
    def mirror_equals_manager_and_kv_reads_back(self):
        if self.x is None:
            return
        kinds = {e["kind"] for e in self.x.sync()}
        for kind in ("offload", "host_hit", "swap_out", "swap_in"):
            if kind in kinds:
                event(f"event {kind}")
        if self.m.host.orders:  # the step is not over: its copies are still queued
            return
        bs = self.bs
        for sid, d in self.digests.items():
            table, kv = self.m.block_table(sid), self._store(sid)
            for p in range(min(self.m.num_tokens(sid), len(d))):
                assert kv.get(table[p // bs] * bs + p % bs) == d[p], (sid, p)


TieredCacheMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestTieredCacheMachine = TieredCacheMachine.TestCase
