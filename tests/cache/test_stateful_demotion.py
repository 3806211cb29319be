"""Hypothesis stateful test of the mixed-precision pool: the rules of test_stateful plus
demotion (engine.cache.demotion) with small watermarks and hot windows, so blocks of
running sequences and cached prefixes are demoted to int8 and then int4 while sequences
keep growing, sharing, forking, being preempted and evicted.

The simulated runner addresses pages by their *page code* (frame, sub-slot, format), as
the kernels do, and executes every demotion batch as the real one does (gather every
source, then scatter), so besides invariants (frames, sub-slots, reclaimable counts) and
mirror == snapshot after every step, every position of every sequence must read back the
digest of its own prefix from wherever its page now lives.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import initialize, invariant, rule

from kvscope.engine.cache.demotion import DemotionPolicy
from tests.cache.conftest import Mirrored
from tests.cache.test_stateful import CacheMachine


class DemotionMachine(CacheMachine):
    @initialize(
        block_size=st.one_of(st.integers(1, 4), st.integers(1, 16)),
        num_frames=st.one_of(st.integers(2, 12), st.integers(2, 64)),
        formats=st.sampled_from([("int8",), ("int4",), ("int8", "int4")]),
        subs8=st.sampled_from([2, 4]),
        hot_window=st.one_of(st.integers(0, 4), st.integers(0, 40)),
        low=st.sampled_from([0.3, 0.6, 0.9]),
        policy=st.sampled_from(["lru", "lfu", "priority"]),
        caching=st.sampled_from([True, True, False]),
    )
    def setup(self, block_size: int, num_frames: int, formats: tuple[str, ...], subs8: int,
              hot_window: int, low: float, policy: str, caching: bool) -> None:
        subs = {"int8": subs8, "int4": 2 * subs8}
        demotion = DemotionPolicy(formats, {f: subs[f] for f in formats}, hot_window,
                                  low=low, high=min(0.95, low + 0.1))
        self.x = Mirrored(num_frames, block_size, eviction_policy=policy,
                          enable_prefix_caching=caching, demotion=demotion)
        self.bs = block_size
        self.demoted = 0
        for base in (0, 1):
            self.admit(base, 3 * block_size + 1, [], 0, None)

    # ------------------------------------------------------ simulated runner
    def _key(self, block: int, offset: int) -> tuple[int, int]:
        return self.m.gpu.page_code(block), offset

    def _write(self, sid: str, start: int, end: int) -> None:
        table, d, bs = self.m.block_table(sid), self.digests[sid], self.bs
        for p in range(start, min(end, len(d))):
            self.kv[self._key(table[p // bs], p % bs)] = d[p]

    def _run_copies(self) -> None:
        for src, dst in self.m.take_copy_orders():
            event("copy-on-write")
            for o in range(self.bs):
                a, b = self._key(src, o), self._key(dst, o)
                if a in self.kv:
                    self.kv[b] = self.kv[a]
                else:
                    self.kv.pop(b, None)

    def _allocate(self, sid: str, n: int) -> None:
        super()._allocate(sid, n)
        self.demote(0)  # the engine demotes between steps, i.e. after every step's writes

    @rule(reserve=st.integers(0, 8))
    def demote(self, reserve: int):
        """``reserve``: frames the next admission needs (the engine's hint)."""
        before = self.m.gpu.num_demoted
        n = self.m.demote_cold_blocks(reserve)
        orders = self.m.take_demotion_orders()
        assert self.m.gpu.num_demoted - before == n >= len(orders)
        assert len({new for _, new in orders}) == len(orders)
        if n:
            event("demotion")
        gathered = [[self.kv.pop((old, o), None) for o in range(self.bs)] for old, _ in orders]
        for (_, new), vals in zip(orders, gathered, strict=True):
            for o, v in enumerate(vals):
                if v is None:
                    self.kv.pop((new, o), None)
                else:
                    self.kv[(new, o)] = v
        self.demoted += n

    @invariant()
    def mirror_equals_manager_and_kv_reads_back(self):
        if self.x is None:
            return
        events = self.x.sync()
        if any(e["kind"] == "quantize" for e in events):
            event("quantize event")
        if any(self.x.state.tiers["gpu"].formats.get(b) == "int4"
               for b in self.x.state.tiers["gpu"].formats):
            event("int4 blocks")
        bs = self.bs
        for sid, d in self.digests.items():
            table = self.m.block_table(sid)
            for p in range(min(self.m.num_tokens(sid), len(d))):
                assert self.kv.get(self._key(table[p // bs], p % bs)) == d[p], (sid, p)


DemotionMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestDemotionMachine = DemotionMachine.TestCase
