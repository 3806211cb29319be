"""The cpu tier at the manager level: dedup of shared blocks on swap-out, sharing on
swap-in, write-back and host hits, the recompute fallback, and bad calls."""

from __future__ import annotations

import pytest

from kvscope.engine.cache import CacheError
from kvscope.engine.cache.transfers import plan_rounds
from tests.cache.conftest import Mirrored, kinds


def running(x: Mirrored, sid: str, prompt: list[int]) -> None:
    m = x.m
    m.add_sequence(sid, prompt)
    hit = m.match_prefix(sid)
    assert m.allocate_slots(sid, len(prompt) - hit) is not None
    m.start(sid)


def test_shared_prefix_has_one_host_copy_and_is_shared_again_on_swap_in():
    x = Mirrored(16, 4, num_cpu_blocks=16)
    m = x.m
    prefix = list(range(1, 9))  # two full blocks
    running(x, "a", prefix + [20, 21])
    running(x, "b", prefix + [30])
    assert m.block_table("a")[:2] == m.block_table("b")[:2]
    x.sync()
    assert m.preempt("a", "swap") == "swap" and m.preempt("b", "swap") == "swap"
    events = x.sync()
    assert kinds(events).count("swap_out") == 2 and "offload" in kinds(events)
    ha, hb = m.block_table("a"), m.block_table("b")
    assert ha[:2] == hb[:2] and ha[2] != hb[2]  # the prefix is on the host once
    assert m.metrics()["tiers"]["cpu"]["used"] == 4
    rounds = m.take_swap_rounds()
    assert len(rounds) == 1 and len(rounds[0][0]) == 4 and rounds[0][1] == []  # 4 copies
    assert m.swap_in("a") and m.swap_in("b")
    ga, gb = m.block_table("a"), m.block_table("b")
    assert ga[:2] == gb[:2]  # shared on the gpu again
    # The prefix was still cached on the gpu (released, not yet evicted): revived, not
    # copied; only the two private last blocks come back over the bus.
    assert sum(len(ins) for _, ins in m.take_swap_rounds()) == 2
    assert m.status("a") == m.status("b") == "running"
    assert m.metrics()["swap_ins"] == 2
    x.sync()


def test_host_full_falls_back_to_recompute():
    x = Mirrored(8, 4, num_cpu_blocks=1)
    running(x, "a", list(range(1, 11)))  # 3 blocks do not fit in 1 host block
    x.sync()
    assert x.m.preempt("a", "swap") == "recompute"
    assert x.m.status("a") == "waiting" and x.m.metrics()["swap_fallbacks"] == 1
    events = x.sync()
    assert [e["mode"] for e in events if e["kind"] == "seq_preempt"] == ["recompute"]


def test_evicted_prefix_comes_back_from_the_host():
    x = Mirrored(4, 4, num_cpu_blocks=8)
    m = x.m
    prompt = list(range(1, 14))  # 3 full blocks + 1 token
    running(x, "a", prompt)
    m.finish("a", "stop")
    x.sync()
    assert m.evict_cached() == 3
    events = x.sync()
    assert kinds(events) == ["evict", "offload"]
    m.add_sequence("b", prompt)
    assert m.match_prefix("b") == 12
    assert m.metrics()["host_hit_tokens"] == 12
    assert "host_hit" in kinds(x.sync())
    (outs, ins), = m.take_swap_rounds()  # write-back first, then the load, one round
    assert len(outs) == 3 and len(ins) == 3


def test_in_then_out_of_the_same_host_block_splits_rounds():
    """A swap-in frees host blocks that a later swap-out in the same step reuses: the
    rounds must read them before overwriting them."""
    x = Mirrored(6, 2, num_cpu_blocks=2, enable_prefix_caching=False)
    m = x.m
    running(x, "a", [1, 2, 3, 4])
    assert m.preempt("a", "swap") == "swap"
    m.take_swap_rounds()
    running(x, "b", [5, 6, 7, 8])
    host_a = m.block_table("a")
    assert m.swap_in("a")
    assert m.preempt("b", "swap") == "swap"
    assert set(m.block_table("b")) == set(host_a)  # the same host blocks, reused
    rounds = m.take_swap_rounds()
    assert len(rounds) == 2 and rounds[0][1] and rounds[1][0]
    x.sync()


def test_bad_calls_on_tiers_change_nothing():
    x = Mirrored(8, 4, num_cpu_blocks=8)
    m = x.m
    running(x, "run", [1, 2, 3, 4, 5])
    running(x, "gone", [9, 9, 9, 9, 9])
    assert m.preempt("gone", "swap") == "swap"
    m.add_sequence("wait", [1, 2])
    x.sync()
    snap, metrics = m.snapshot(), m.metrics()
    for call in (lambda: m.swap_in("run"), lambda: m.swap_in("wait"),
                 lambda: m.can_swap_in("run"), lambda: m.can_swap_in("gone", -1),
                 lambda: m.can_swap_in("gone", 1, 1.5), lambda: m.free("gone"),
                 lambda: m.resume("gone"), lambda: m.allocate_slots("gone", 1),
                 lambda: m.allocate_slots("gone", 4), lambda: m.can_allocate("gone", 1),
                 lambda: m.match_prefix("gone"), lambda: m.fork("gone", "kid"),
                 lambda: m.preempt("gone", "swap"), lambda: m.preempt("run", "drop")):
        with pytest.raises(CacheError):
            call()
        assert m.snapshot() == snap and m.metrics() == metrics
    assert x.sync() == []
    m.finish("gone", "abort")  # a swapped sequence can finish: its host blocks are freed
    assert [e["tier"] for e in x.sync() if e["kind"] == "free"] == ["cpu"]
    assert m.metrics()["tiers"]["cpu"]["used"] == 0
    assert plan_rounds([]) == []
