"""Free lists and eviction: uncached first, lazy eviction, LRU/LFU/priority order, revival."""

from __future__ import annotations

import pytest

from kvscope.engine.cache import CacheError, make_policy
from kvscope.engine.cache.eviction import LFUPolicy, LRUPolicy, PriorityPolicy
from tests.cache.conftest import Mirrored, kinds


def _cache_one_block(x: Mirrored, sid: str, first_token: int, priority: int = 0) -> int:
    """A finished 1-block sequence: leaves one cached free block; returns its id."""
    x.m.add_sequence(sid, [first_token, 0], priority=priority)
    x.m.allocate_slots(sid, 2)
    (b,) = x.m.block_table(sid)
    x.m.finish(sid, "stop")
    return b


def test_fresh_pool_hands_out_ascending_ids_and_reuses_uncached_blocks_first():
    x = Mirrored(6, 2)
    x.m.add_sequence("a", [1, 2, 3, 4, 5])  # blocks 0, 1 cached after finish; 2 partial
    x.m.allocate_slots("a", 5)
    assert x.m.block_table("a") == [0, 1, 2]
    x.m.finish("a", "stop")
    x.sync()
    assert x.m.metrics()["tiers"]["gpu"] == {"total": 6, "used": 0, "cached": 2, "free": 4}
    x.m.add_sequence("b", [9] * 8)  # needs 4 blocks: the 4 uncached ones, no eviction
    x.m.allocate_slots("b", 8)
    assert sorted(x.m.block_table("b")) == [2, 3, 4, 5]
    ev = x.sync()
    assert "evict" not in kinds(ev)
    assert x.m.metrics()["evictions"] == 0


def test_eviction_is_lazy_and_in_lru_order():
    x = Mirrored(3, 2)
    first = [_cache_one_block(x, f"s{i}", 100 + i) for i in range(3)]
    x.sync()
    assert x.m.metrics()["tiers"]["gpu"]["cached"] == 3  # nothing evicted before it is needed
    x.m.add_sequence("n", [7, 7])
    x.m.allocate_slots("n", 2)
    ev = x.sync()
    assert [e["blocks"] for e in ev if e["kind"] == "evict"] == [[first[0]]]  # oldest first
    assert kinds(ev).index("evict") < kinds(ev).index("alloc")
    # The evicted prefix misses; the two others still hit.
    for i, expect in ((0, 0), (1, 2), (2, 2)):
        x.m.add_sequence(f"q{i}", [100 + i, 0, 5])
        assert x.m.match_prefix(f"q{i}") == expect
        x.m.free(f"q{i}")
    x.sync()


def test_a_sequence_tail_is_evicted_before_its_head():
    x = Mirrored(4, 1)
    x.m.add_sequence("a", [1, 2, 3, 4])
    x.m.allocate_slots("a", 4)
    x.m.finish("a", "stop")
    x.sync()
    x.m.add_sequence("b", [9])
    x.m.allocate_slots("b", 1)
    ev = x.sync()
    assert [e["blocks"] for e in ev if e["kind"] == "evict"] == [[3]]


def test_a_prefix_hit_revives_a_cached_block_from_the_middle_of_the_queue():
    x = Mirrored(3, 2)
    blocks = [_cache_one_block(x, f"s{i}", 100 + i) for i in range(3)]
    x.m.add_sequence("hit", [101, 0, 5])
    assert x.m.match_prefix("hit") == 2  # revives the middle block
    assert x.m.block_table("hit") == [blocks[1]]
    assert x.m.metrics()["tiers"]["gpu"] == {"total": 3, "used": 1, "cached": 2, "free": 0}
    x.sync()
    x.m.free("hit")  # back at the tail: now the most recently freed
    x.m.add_sequence("n", [7, 7, 7, 7])
    x.m.allocate_slots("n", 4)
    ev = x.sync()
    assert [e["blocks"] for e in ev if e["kind"] == "evict"] == [sorted([blocks[0], blocks[2]])]


def test_lru_policy_order_and_removal_from_the_middle():
    p = LRUPolicy()
    p.push([5, 3, 9, 1])
    p.remove([9])
    assert 9 not in p and len(p) == 3
    p.push([9])
    assert p.pop(2) == [5, 3]
    assert p.pop(2) == [1, 9]


def test_lfu_policy_prefers_rarely_used_blocks_and_ages():
    p = LFUPolicy()
    p.touch([1], 0)
    p.touch([2], 0)
    p.touch([2], 0)
    p.touch([2], 0)
    p.push([2, 1])  # 2 used 3 times, 1 once
    assert p.pop(1) == [1]  # less used, although freed later
    p.touch([3], 0)
    p.push([3])  # score = clock (1) + 1 use = 2 < 2's score of 3
    assert p.pop(1) == [3]
    # Aging: the clock is now 2, so blocks freed now with 1 use score 3, the score that
    # block 2 earned with 3 uses long ago; ties go to the least recently freed: block 2.
    for b in range(10, 14):
        p.touch([b], 0)
        p.push([b])
    p.remove([12])
    assert p.pop(2) == [2, 10]
    assert p.pop(2) == [11, 13]
    assert len(p) == 0


def test_lfu_stale_entries_are_compacted():
    p = LFUPolicy()
    for _ in range(50):
        p.push(list(range(10)))
        p.remove(list(range(10)))
    assert len(p._heap) <= 2 * len(p) + 64 + 1
    p.push([4])
    assert p.pop(1) == [4]


def test_priority_policy_evicts_low_priority_first_lru_within():
    p = PriorityPolicy()
    p.touch([1, 2], 5)
    p.touch([3], 0)
    p.touch([4], 9)
    p.touch([1], 1)  # keeps the highest priority seen: 5
    p.push([1, 3, 4, 2])
    p.remove([4])
    p.push([4])
    assert p.pop(1) == [3]
    assert p.pop(2) == [1, 2]
    assert p.pop(1) == [4]
    assert len(p) == 0 and p._levels == {}


def test_priority_policy_in_the_manager_keeps_important_prefixes():
    x = Mirrored(2, 2, eviction_policy="priority")
    important = _cache_one_block(x, "vip", 1, priority=10)
    low = _cache_one_block(x, "low", 2, priority=0)  # freed later, but less important
    assert low != important
    x.sync()
    x.m.add_sequence("n", [7, 7])
    x.m.allocate_slots("n", 2)
    ev = x.sync()
    assert [e["blocks"] for e in ev if e["kind"] == "evict"] == [[low]]  # LRU would pick vip
    x.m.add_sequence("q", [1, 0, 3])
    assert x.m.match_prefix("q") == 2
    x.sync()


@pytest.mark.parametrize("policy", ["lru", "lfu", "priority"])
def test_every_policy_runs_the_manager(policy):
    x = Mirrored(4, 2, eviction_policy=policy)
    for i in range(6):
        _cache_one_block(x, f"s{i}", i)
        x.sync()
    assert x.m.metrics()["evictions"] == 2


def test_unknown_policy_is_a_cache_error():
    with pytest.raises(CacheError, match="unknown eviction policy"):
        make_policy("fifo")


def test_evict_cached_resets_the_prefix_cache():
    x = Mirrored(4, 2)
    for i in range(3):
        _cache_one_block(x, f"s{i}", i)
    x.sync()
    assert x.m.evict_cached(1) == 1
    assert x.m.evict_cached() == 2
    ev = x.sync()
    assert kinds(ev) == ["evict", "evict"]
    assert x.m.metrics()["tiers"]["gpu"] == {"total": 4, "used": 0, "cached": 0, "free": 4}
