"""Bad calls raise CacheError and change nothing: no state, no event, no counter."""

from __future__ import annotations

import pytest

from kvscope.engine.cache import CacheError, KVCacheManager
from tests.cache.conftest import Mirrored


@pytest.fixture
def busy():
    """A manager with a running, a waiting, a finished and a forked sequence."""
    x = Mirrored(8, 4)
    m = x.m
    m.add_sequence("run", [1, 2, 3, 4, 5, 6])
    m.allocate_slots("run", 6)
    m.start("run")
    m.add_sequence("wait", [1, 2, 3, 4, 9])
    m.add_sequence("done", [5])
    m.allocate_slots("done", 1)
    m.finish("done", "stop")
    m.fork("run", "kid")
    x.sync()
    return x


BAD_CALLS = {
    "unknown seq: append": lambda m: m.append_token_ids("nope", [1]),
    "unknown seq: allocate": lambda m: m.allocate_slots("nope", 1),
    "unknown seq: allocate many": lambda m: m.allocate_slots("nope", 5),
    "unknown seq: can_allocate": lambda m: m.can_allocate("nope", 1),
    "unknown seq: match": lambda m: m.match_prefix("nope"),
    "unknown seq: free": lambda m: m.free("nope"),
    "unknown seq: finish": lambda m: m.finish("nope", "stop"),
    "unknown seq: preempt": lambda m: m.preempt("nope"),
    "unknown seq: start": lambda m: m.start("nope"),
    "unknown seq: resume": lambda m: m.resume("nope"),
    "unknown seq: block_table": lambda m: m.block_table("nope"),
    "unknown seq: num_tokens": lambda m: m.num_tokens("nope"),
    "unknown seq: fork parent": lambda m: m.fork("nope", "x"),
    "non-str seq id": lambda m: m.allocate_slots(7, 1),
    "finished: append": lambda m: m.append_token_ids("done", [1]),
    "finished: allocate": lambda m: m.allocate_slots("done", 1),
    "finished: free": lambda m: m.free("done"),
    "finished: finish again": lambda m: m.finish("done", "stop"),
    "negative count": lambda m: m.allocate_slots("run", -1),
    "negative count, can_allocate": lambda m: m.can_allocate("run", -3),
    "float count": lambda m: m.allocate_slots("run", 1.5),
    "None count": lambda m: m.allocate_slots("run", None),
    "bad watermark": lambda m: m.can_allocate("run", 1, watermark=1.0),
    "negative watermark": lambda m: m.can_allocate("run", 1, watermark=-0.1),
    "duplicate seq id": lambda m: m.add_sequence("run", [1]),
    "duplicate fork child": lambda m: m.fork("run", "wait"),
    "non-str fork child": lambda m: m.fork("run", 3),
    "non-str new seq id": lambda m: m.add_sequence(3, [1]),
    "empty prompt": lambda m: m.add_sequence("new", []),
    "negative token id": lambda m: m.add_sequence("new", [1, -2, 3]),
    "None token id": lambda m: m.add_sequence("new", [1, None]),
    "str prompt": lambda m: m.add_sequence("new", "hello"),
    "int prompt": lambda m: m.add_sequence("new", 5),
    "non-int priority": lambda m: m.add_sequence("new", [1], priority="high"),
    "non-str salt": lambda m: m.add_sequence("new", [1], cache_salt=b"x"),
    "negative appended id": lambda m: m.append_token_ids("run", [-1]),
    "None appended id": lambda m: m.append_token_ids("run", [None]),
    "start twice": lambda m: m.start("run"),
    "resume a never-preempted waiting seq": lambda m: m.resume("wait"),
    "resume a running seq": lambda m: m.resume("run"),
    "preempt a waiting seq": lambda m: m.preempt("wait"),
    "swap preemption without a cpu tier": lambda m: m.preempt("run", mode="swap"),
    "unknown preemption mode": lambda m: m.preempt("run", mode="drop"),
    "unknown finish reason": lambda m: m.finish("run", "bored"),
    "match while holding blocks": lambda m: m.match_prefix("run"),
    "negative evict": lambda m: m.evict_cached(-1),
}


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_call_raises_and_changes_nothing(busy, name):
    m = busy.m
    snap, metrics = m.snapshot(), m.metrics()
    tokens = {sid: m.token_ids(sid) for sid in ("run", "wait", "kid")}
    with pytest.raises(CacheError):
        BAD_CALLS[name](m)
    assert m.snapshot() == snap
    assert m.metrics() == metrics
    assert {sid: m.token_ids(sid) for sid in tokens} == tokens
    assert m.take_copy_orders() == []
    assert busy.sync() == []  # no event was emitted either


@pytest.mark.parametrize("kwargs", [
    dict(num_gpu_blocks=0, block_size=16),
    dict(num_gpu_blocks=-4, block_size=16),
    dict(num_gpu_blocks=4, block_size=0),
    dict(num_gpu_blocks=4.0, block_size=16),
    dict(num_gpu_blocks=4, block_size=16, num_cpu_blocks=-1),
    dict(num_gpu_blocks=4, block_size=16, kv_format="int3"),
    dict(num_gpu_blocks=4, block_size=16, eviction_policy="random"),
])
def test_bad_configuration_is_rejected(kwargs):
    with pytest.raises(CacheError):
        KVCacheManager(**kwargs)


def test_cache_error_is_a_value_error_with_a_clear_message():
    m = KVCacheManager(4, 2)
    with pytest.raises(ValueError, match="unknown sequence 'ghost'"):
        m.free("ghost")
    with pytest.raises(CacheError, match="at least one block"):
        KVCacheManager(0, 2)
