"""The disk tier at the manager level: host evictions go to disk, a waiting sequence's
prefix is prefetched back and hit on the host, failures and restarts; every step the
KVState rebuilt from the events equals the manager (tests.cache.conftest.Mirrored)."""

from __future__ import annotations

import random

import pytest

from kvscope.engine.cache import CacheError
from kvscope.engine.cache.hashing import chain_hashes
from kvscope.engine.cache.transfers import FILL, SAVE, DiskBatch
from tests.cache.conftest import Mirrored, kinds
from tests.disk.fake_disk import FakeDisk

BS = 4


def run_prompt(x: Mirrored, sid: str, prompt: list[int]) -> int:
    """Admit, compute and finish ``prompt``; returns the prefix hit in tokens."""
    m = x.m
    m.add_sequence(sid, prompt)
    hit = m.match_prefix(sid)
    assert m.allocate_slots(sid, len(prompt) - hit) is not None
    m.start(sid)
    m.finish(sid, "stop")
    x.sync()
    return hit


def spill(x: Mirrored, disk: FakeDisk, seed: int, n: int = 3) -> None:
    """Run other prompts until earlier prefixes leave the gpu and the host."""
    rng = random.Random(seed)
    for i in range(n):
        run_prompt(x, f"filler{seed}-{i}", [rng.randrange(1000, 2000) for _ in range(3 * BS + 1)])
        disk.run(x.m)
        disk.report(x.m)
        x.sync()


def test_evicted_prefix_goes_to_disk_and_is_prefetched_back():
    x = Mirrored(4, BS, num_cpu_blocks=4, num_disk_blocks=32)
    m, disk = x.m, FakeDisk()
    prompt = list(range(1, 14))  # 3 full blocks + 1
    run_prompt(x, "a", prompt)
    spill(x, disk, 0)
    assert m.metrics()["tiers"]["disk"]["cached"] >= 3
    assert "disk_store" in kinds(x.events)
    m.add_sequence("b", prompt)
    assert m.prefetch("b")  # reads start; it must wait
    assert kinds(x.sync())[-1] == "prefetch"
    assert m.prefetch("b")  # still in flight: nothing new is started
    disk.run(m)
    disk.report(m)  # the reads arrive: host blocks take them
    events = x.sync()
    assert "disk_load" in kinds(events)
    fills = [op for r in disk.run(m) if isinstance(r, DiskBatch) for op in r if op.kind == FILL]
    assert len(fills) == 3
    assert not m.prefetch("b")  # arrived: schedule it
    assert m.match_prefix("b") == 12
    assert m.metrics()["host_hit_tokens"] >= 12
    assert m.disk.arrived_blocks == 3 and m.disk.read_misses == 0
    x.sync()


def test_torn_file_is_a_miss_and_leaves_the_index():
    x = Mirrored(4, BS, num_cpu_blocks=4, num_disk_blocks=32)
    m, disk = x.m, FakeDisk()
    prompt = list(range(1, 14))
    run_prompt(x, "a", prompt)
    spill(x, disk, 1)
    on_disk = dict(disk.files)
    disk.bad_files = set(on_disk)  # every file is torn
    m.add_sequence("b", prompt)
    assert m.prefetch("b")
    x.sync()
    disk.run(m)
    disk.report(m)
    events = x.sync()
    arrive = [e for e in events if e["kind"] == "disk_load"]
    assert arrive and arrive[0]["missed"] == 3 and not arrive[0]["dst"]
    assert any(e["kind"] == "evict" and e["tier"] == "disk" for e in events)
    assert not m.prefetch("b") and m.match_prefix("b") == 0  # recompute, never wrong KV
    assert m.disk.read_misses == 3
    x.sync()


def test_failed_write_is_never_read_and_leaves_the_index():
    x = Mirrored(4, BS, num_cpu_blocks=4, num_disk_blocks=32)
    m, disk = x.m, FakeDisk()
    prompt = list(range(1, 14))
    run_prompt(x, "a", prompt)
    first = set(m.disk.disk.cached)
    # the filler's evictions carry "a"'s blocks to disk; make those writes fail
    disk.fail_writes = set(chain_hashes(prompt, BS))
    spill(x, disk, 2)
    assert not first and not set(chain_hashes(prompt, BS)) & set(m.disk.disk.cached)
    assert m.disk.write_failures == 3
    m.add_sequence("b", prompt)
    assert not m.prefetch("b")
    x.sync()


def test_pending_write_is_not_read():
    x = Mirrored(4, BS, num_cpu_blocks=4, num_disk_blocks=32)
    m, disk = x.m, FakeDisk()
    prompt = list(range(1, 14))
    run_prompt(x, "a", prompt)
    rng = random.Random(3)
    for i in range(3):  # spill without reporting the writes
        run_prompt(x, f"f{i}", [rng.randrange(1000, 2000) for _ in range(3 * BS + 1)])
    disk.run(m)
    m.add_sequence("b", prompt)
    assert not m.prefetch("b")  # its files are not confirmed yet
    disk.report(m)
    m.free("b")
    x.sync()
    assert m.prefetch("b")
    x.sync()


def test_give_up_counts_and_late_arrivals_still_become_host_cache():
    x = Mirrored(4, BS, num_cpu_blocks=4, num_disk_blocks=32)
    m, disk = x.m, FakeDisk()
    prompt = list(range(1, 14))
    run_prompt(x, "a", prompt)
    spill(x, disk, 4)
    m.add_sequence("b", prompt)
    assert m.prefetch("b")
    m.give_up_prefetch("b")
    assert m.disk.prefetch_timeouts == 1
    assert m.match_prefix("b") == 0  # recomputes
    x.sync()
    disk.run(m)
    disk.report(m)
    x.sync()
    m.finish("b", "stop")
    x.sync()
    assert m.disk.arrived_blocks == 3  # the host holds them for the next request


def test_restart_adopts_files_and_serves_them():
    x = Mirrored(4, BS, num_cpu_blocks=4, num_disk_blocks=32)
    disk = FakeDisk()
    prompt = list(range(1, 14))
    salted = list(range(50, 63))
    run_prompt(x, "a", prompt)
    x.m.add_sequence("s", salted, cache_salt="tenant")
    x.m.allocate_slots("s", len(salted))
    x.m.start("s")
    x.m.finish("s", "stop")
    x.sync()
    spill(x, disk, 5, n=4)
    found = disk.found()
    assert len(found) >= 6
    # a new process: empty gpu and host, the directory's files adopted
    y = Mirrored(4, BS, num_cpu_blocks=4, num_disk_blocks=32)
    assert y.m.adopt_disk(found) == len(found)
    assert kinds(y.sync()) == ["store"]
    y.m.add_sequence("b", prompt)
    assert y.m.prefetch("b")
    y.sync()
    disk.run(y.m)
    disk.report(y.m)
    y.sync()
    assert not y.m.prefetch("b") and y.m.match_prefix("b") == 12
    y.m.finish("b", "stop")
    y.sync()
    # the salted chain is served only to its salt
    y.m.add_sequence("other", salted)
    assert not y.m.prefetch("other")
    y.m.add_sequence("t", salted, cache_salt="tenant")
    assert y.m.prefetch("t")
    y.sync()
    disk.run(y.m)
    disk.report(y.m)
    y.sync()
    assert y.m.match_prefix("t") == 12
    y.sync()


def test_adopt_keeps_the_most_recent_that_fit():
    y = Mirrored(4, BS, num_cpu_blocks=4, num_disk_blocks=2)
    found = [(h, 0, True, (h, h, h, h)) for h in (10, 11, 12)]
    assert y.m.adopt_disk(found) == 2
    assert set(y.m.disk.disk.cached) == {11, 12}
    rounds = y.m.take_swap_rounds()
    assert [(op.kind, op.hash) for r in rounds for op in r] == [("drop", 10)]
    y.sync()


def test_disk_lru_evicts_and_drops_files():
    x = Mirrored(4, BS, num_cpu_blocks=4, num_disk_blocks=6)
    m, disk = x.m, FakeDisk()
    spill(x, disk, 6, n=6)
    assert m.metrics()["tiers"]["disk"]["cached"] == 6
    assert any(e["kind"] == "evict" and e["tier"] == "disk" for e in x.events)
    assert len(disk.files) == 6  # every evicted block's file was dropped


def test_disable_forgets_the_tier():
    x = Mirrored(4, BS, num_cpu_blocks=4, num_disk_blocks=32)
    m, disk = x.m, FakeDisk()
    spill(x, disk, 7)
    assert m.metrics()["tiers"]["disk"]["cached"]
    m.disk_results([], [], disabled=True)
    x.sync()
    assert m.metrics()["tiers"]["disk"]["cached"] == 0
    spill(x, disk, 8)  # nothing is written any more
    assert m.metrics()["tiers"]["disk"]["cached"] == 0
    assert not [op for r in m.take_swap_rounds() if isinstance(r, DiskBatch) for op in r
                if op.kind == SAVE]


def test_needs_a_host_tier_and_prefix_caching():
    with pytest.raises(CacheError, match="disk tier needs"):
        Mirrored(4, BS, num_disk_blocks=8)
    with pytest.raises(CacheError, match="disk tier needs"):
        Mirrored(4, BS, num_cpu_blocks=4, num_disk_blocks=8, enable_prefix_caching=False)
    with pytest.raises(CacheError, match="num_disk_blocks"):
        Mirrored(4, BS, num_cpu_blocks=4, num_disk_blocks=-1)
