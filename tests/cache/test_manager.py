"""Unit tests of KVCacheManager's rules; every test also checks the event mirror."""

from __future__ import annotations

from kvscope.engine.cache import KVCacheManager, slot_mapping
from kvscope.engine.cache.hashing import chain_hashes
from tests.cache.conftest import Mirrored, kinds


def test_first_events_are_tier_init_per_tier():
    x = Mirrored(4, 2)
    assert x.events == [
        {"kind": "tier_init", "tier": "gpu", "num_blocks": 4, "block_size": 2, "format": "auto"}
    ]
    y = Mirrored(4, 2, num_cpu_blocks=3, kv_format="int8")
    assert [(e["tier"], e["num_blocks"], e["format"]) for e in y.events] == [
        ("gpu", 4, "int8"), ("cpu", 3, "int8")
    ]
    assert y.m.metrics()["tiers"]["cpu"] == {"total": 3, "used": 0, "cached": 0, "free": 3}


def test_blocks_are_allocated_on_demand_and_slots_follow_the_table():
    x = Mirrored(8, 4)
    x.m.add_sequence("a", list(range(1, 6)))
    assert x.m.allocate_slots("a", 3) == [0, 1, 2]  # one block, not the prompt's two
    assert x.m.block_table("a") == [0]
    assert x.m.allocate_slots("a", 2) == [3, 4]
    assert x.m.block_table("a") == [0, 1]
    assert x.m.num_tokens("a") == 5
    x.sync()
    m = x.m.metrics()
    assert m["tiers"]["gpu"]["used"] == 2
    assert m["used_tokens"] == 5  # usage by tokens differs from usage by blocks
    assert m["block_usage"] == 2 / 8 and m["token_usage"] == 5 / 32


def test_slot_mapping_across_non_contiguous_blocks():
    table = [5, 6, 2, 3, 9]
    assert slot_mapping(table, 4, 3, 17) == [23] + [24, 25, 26, 27] + [8, 9, 10, 11] + [
        12, 13, 14, 15] + [36]
    assert slot_mapping([7], 4, 1, 3) == [29, 30]
    assert slot_mapping([0, 1, 2], 1, 0, 3) == [0, 1, 2]


def test_decode_fast_path_and_block_boundary():
    x = Mirrored(4, 4)
    x.m.add_sequence("a", [1, 2, 3])
    assert x.m.allocate_slots("a", 3) == [0, 1, 2]
    x.m.start("a")
    x.sync()
    x.m.append_token_ids("a", [4])
    assert x.m.allocate_slots("a", 1) == [3]  # fills block 0: it is stored
    ev = x.sync()
    assert kinds(ev) == ["store", "seq_tokens"]
    x.m.append_token_ids("a", [5])
    assert x.m.allocate_slots("a", 1) == [4]  # boundary: a new block
    assert kinds(x.sync()) == ["alloc", "seq_tokens"]


def test_allocation_failure_returns_none_and_changes_nothing():
    x = Mirrored(2, 4)
    x.m.add_sequence("a", list(range(12)))
    x.sync()
    before = x.m.snapshot()
    assert not x.m.can_allocate("a", 12)
    assert x.m.allocate_slots("a", 12) is None
    assert x.m.snapshot() == before and x.sync() == []
    assert x.m.can_allocate("a", 8)
    assert x.m.can_allocate("a", 4, watermark=0.5)
    assert not x.m.can_allocate("a", 8, watermark=0.5)  # keeps 1 of 2 blocks in reserve


def test_prefix_hit_shares_blocks_and_counts_tokens():
    x = Mirrored(16, 4)
    prompt = list(range(100, 110))  # 2 full blocks + 2 tokens
    x.m.add_sequence("a", prompt)
    assert x.m.match_prefix("a") == 0
    x.m.allocate_slots("a", 10)
    x.sync()
    x.m.add_sequence("b", prompt + [7, 8, 9])
    assert x.m.match_prefix("b") == 8
    assert x.m.block_table("b") == x.m.block_table("a")[:2]
    assert x.m.num_tokens("b") == 8
    ev = x.sync()
    assert [e for e in ev if e["kind"] == "hit"] == [
        {"kind": "hit", "tier": "gpu", "seq": "b", "blocks": [0, 1], "tokens": 8}
    ]
    assert x.state.tiers["gpu"].ref.tolist()[:3] == [2, 2, 1]
    m = x.m.metrics()
    assert (m["prefix_query_tokens"], m["prefix_hit_tokens"]) == (10 + 13, 8)
    assert x.m.allocate_slots("b", 5) == [12, 13, 14, 15, 16]  # a holds 0-2: b gets 3, 4
    x.sync()


def test_full_hit_is_capped_so_the_last_token_is_computed():
    x = Mirrored(16, 4)
    prompt = list(range(8))  # exactly two full blocks
    x.m.add_sequence("a", prompt)
    x.m.allocate_slots("a", 8)
    x.m.add_sequence("b", prompt)
    assert x.m.match_prefix("b") == 4  # not 8: the last block holds the last token
    x.m.add_sequence("c", prompt + [99])
    assert x.m.match_prefix("c") == 8
    x.sync()


def test_hashes_are_the_documented_chain_and_salts_separate_caches():
    x = Mirrored(16, 2)
    x.m.add_sequence("a", [1, 2, 3, 4, 5], cache_salt="tenant-1")
    x.m.allocate_slots("a", 5)
    ev = x.sync()
    store = [e for e in ev if e["kind"] == "store"]
    assert store[0]["hashes"] == chain_hashes([1, 2, 3, 4, 5], 2, "tenant-1")
    assert chain_hashes([1, 2], 2, "tenant-1") != chain_hashes([1, 2], 2, "tenant-2")
    assert chain_hashes([1, 2], 2, "") != chain_hashes([1, 2], 2)
    x.m.add_sequence("b", [1, 2, 3, 4, 5], cache_salt="tenant-2")
    x.m.add_sequence("c", [1, 2, 3, 4, 5])
    x.m.add_sequence("d", [1, 2, 3, 4, 5], cache_salt="tenant-1")
    assert (x.m.match_prefix("b"), x.m.match_prefix("c"), x.m.match_prefix("d")) == (0, 0, 4)
    x.sync()


def test_hashes_are_deterministic_across_processes():
    import subprocess
    import sys

    code = ("from kvscope.engine.cache.hashing import chain_hashes; "
            "print(chain_hashes(list(range(64)), 16, 'salt'))")
    outs = set()
    for seed in ("1", "2"):
        env = {"PYTHONHASHSEED": seed, "PATH": ""}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                text=True, check=True, cwd=".").stdout)
    assert len(outs) == 1
    assert outs == {str(chain_hashes(list(range(64)), 16, "salt")) + "\n"}
    assert all(-(2**63) <= h < 2**63 for h in chain_hashes(list(range(64)), 16, "salt"))


def test_a_hash_collision_is_a_miss_not_a_wrong_hit():
    x = Mirrored(16, 2)
    x.m.add_sequence("a", [1, 2, 3, 4, 5])
    x.m.allocate_slots("a", 5)
    x.sync()
    pool = x.m.gpu
    # Point the hash of b's first block at a's block 0, as a colliding hash would.
    (hb,) = chain_hashes([7, 8], 2)
    pool.cached[hb] = 0
    x.m.add_sequence("b", [7, 8, 9])
    assert x.m.match_prefix("b") == 0  # tokens differ: verified, not trusted
    del pool.cached[hb]
    # Same tokens and same hash, but the parent is another cache entry: also a miss.
    e = pool.entry[1]
    pool.entry[1] = (e[0], -12345, e[2], e[3])
    x.m.add_sequence("c", [1, 2, 3, 4, 5])
    assert x.m.match_prefix("c") == 2
    pool.entry[1] = e
    x.sync()


def test_duplicate_content_is_indexed_once():
    x = Mirrored(16, 2)
    x.m.add_sequence("a", [1, 2, 3])
    x.m.add_sequence("b", [1, 2, 3])
    x.m.allocate_slots("a", 3)  # both computed the same prefix (no match in between)
    x.m.allocate_slots("b", 3)
    ev = x.sync()
    assert [e["blocks"] for e in ev if e["kind"] == "store"] == [[0]]
    x.m.finish("b", "stop")
    x.sync()
    assert x.m.metrics()["tiers"]["gpu"]["cached"] == 0  # b's copy went back as plain free
    x.m.finish("a", "stop")
    x.sync()
    assert x.m.metrics()["tiers"]["gpu"]["cached"] == 1


def test_a_block_after_a_duplicate_still_chains_to_the_indexed_entry():
    x = Mirrored(16, 2)
    x.m.add_sequence("a", [1, 2, 3])
    x.m.add_sequence("b", [1, 2, 3, 4, 5])
    x.m.allocate_slots("a", 3)
    x.m.allocate_slots("b", 5)  # b's block 0 duplicates a's; b's block 1 is new
    x.m.add_sequence("c", [1, 2, 3, 4, 5])
    assert x.m.match_prefix("c") == 4
    assert x.m.block_table("c") == [x.m.block_table("a")[0], x.m.block_table("b")[1]]
    x.sync()


def test_lookahead_slots_are_stored_when_their_ids_arrive():
    x = Mirrored(8, 2)
    x.m.add_sequence("a", [1])
    x.sync()
    x.m.allocate_slots("a", 4)  # slots ahead of known ids (speculative decoding)
    assert kinds(x.sync()) == ["alloc", "seq_tokens"]
    x.m.append_token_ids("a", [2])
    assert kinds(x.sync()) == ["store"]
    x.m.append_token_ids("a", [3, 4])
    ev = x.sync()
    assert kinds(ev) == ["store"] and ev[0]["blocks"] == [1]


def test_copy_on_write_after_fork():
    x = Mirrored(8, 4)
    x.m.add_sequence("p", [1, 2, 3, 4, 5, 6])
    x.m.allocate_slots("p", 6)
    x.m.start("p")
    x.m.fork("p", "c")
    ev = x.sync()
    assert kinds(ev) == ["seq_add", "alloc", "store", "seq_start", "seq_add", "fork", "seq_start",
                         "seq_tokens"]
    assert x.m.status("c") == "running" and x.m.token_ids("c") == [1, 2, 3, 4, 5, 6]
    assert x.state.tiers["gpu"].ref.tolist()[:2] == [2, 2]
    x.m.append_token_ids("c", [9])
    assert x.m.can_allocate("c", 1) and x.m._alloc.blocks_needed(x.m.sequences["c"], 1) == 1
    assert x.m.allocate_slots("c", 1) == [2 * 4 + 2]  # private copy of block 1 is block 2
    assert x.m.take_copy_orders() == [(1, 2)]
    assert x.m.take_copy_orders() == []
    ev = x.sync()
    assert ev[0] == {"kind": "cow", "tier": "gpu", "seq": "c", "logical": [1], "src": [1],
                     "dst": [2]}
    assert x.m.block_table("c") == [0, 2] and x.m.block_table("p") == [0, 1]
    x.m.append_token_ids("p", [8])
    assert x.m.allocate_slots("p", 1) == [1 * 4 + 2]  # p is alone on block 1 now: no copy
    assert x.m.take_copy_orders() == []
    assert x.m.metrics()["cow_copies"] == 1
    x.sync()
    x.m.append_token_ids("p", [7])
    x.m.append_token_ids("c", [7])
    x.m.allocate_slots("p", 1)
    x.m.allocate_slots("c", 1)
    x.sync()
    # Both blocks now hold [5, 6, x, 7] with x differing: two different cache entries.
    assert x.m.metrics()["stored_blocks"] == 3


def test_fork_of_full_blocks_needs_no_copy():
    x = Mirrored(8, 2)
    x.m.add_sequence("p", [1, 2, 3, 4])
    x.m.allocate_slots("p", 4)
    x.m.fork("p", "c")
    assert x.m.status("c") == "waiting"
    x.m.append_token_ids("c", [5])
    assert x.m.allocate_slots("c", 1) == [4]
    assert x.m.take_copy_orders() == []
    x.sync()


def test_preempt_frees_blocks_keeps_tokens_and_resume_rematches():
    x = Mirrored(8, 2)
    x.m.add_sequence("a", [1, 2, 3])
    x.m.allocate_slots("a", 3)
    x.m.start("a")
    x.m.append_token_ids("a", [4])
    x.m.allocate_slots("a", 1)
    x.m.append_token_ids("a", [5])
    x.sync()
    x.m.preempt("a")
    assert kinds(x.sync()) == ["free", "seq_preempt"]
    assert x.m.status("a") == "waiting" and x.m.num_tokens("a") == 0
    assert x.m.token_ids("a") == [1, 2, 3, 4, 5]
    assert x.m.match_prefix("a") == 4  # its own cached blocks, generated token included
    x.m.allocate_slots("a", 1)
    x.m.resume("a")
    assert kinds(x.sync()) == ["hit", "alloc", "seq_resume", "seq_tokens"]
    assert x.m.metrics()["preemptions"] == 1
    x.m.finish("a", "length")
    assert kinds(x.sync()) == ["free", "seq_finish"]
    assert "a" not in x.m and x.m.metrics()["num_seqs"] == 0


def test_free_keeps_the_sequence_and_match_requires_an_empty_table():
    import pytest

    from kvscope.engine.cache import CacheError

    x = Mirrored(8, 2)
    x.m.add_sequence("a", [1, 2, 3])
    x.m.allocate_slots("a", 3)
    with pytest.raises(CacheError, match="already holds blocks"):
        x.m.match_prefix("a")
    x.m.free("a")
    assert x.m.status("a") == "waiting" and x.m.block_table("a") == []
    x.sync()


def test_prefix_caching_disabled_indexes_nothing():
    x = Mirrored(8, 2, enable_prefix_caching=False)
    x.m.add_sequence("a", [1, 2, 3, 4, 5])
    x.m.allocate_slots("a", 5)
    x.m.finish("a", "stop")
    x.m.add_sequence("b", [1, 2, 3, 4, 5])
    assert x.m.match_prefix("b") == 0
    assert "store" not in kinds(x.sync())
    assert x.m.metrics()["tiers"]["gpu"]["cached"] == 0


def test_manager_without_sink_emits_nothing_and_keeps_working():
    m = KVCacheManager(4, 2)
    m.add_sequence("a", [1, 2, 3])
    assert m.allocate_slots("a", 3) == [0, 1, 2]
    m.flush_step_events()
    m.check_invariants()
    assert m.snapshot()["seqs"]["a"]["num_tokens"] == 3


def test_numpy_prompts_are_accepted():
    import numpy as np

    x = Mirrored(4, 2)
    x.m.add_sequence("a", np.arange(1, 6, dtype=np.int32))
    assert x.m.token_ids("a") == [1, 2, 3, 4, 5]
    assert all(type(t) is int for t in x.m.token_ids("a"))
    x.sync()


def test_watermark_never_blocks_a_step_that_needs_no_block():
    x = Mirrored(2, 4)
    x.m.add_sequence("a", [1, 2, 3, 4, 5])
    x.m.allocate_slots("a", 5)
    assert x.m.can_allocate("a", 3, watermark=0.9)  # fits in its last block
    assert not x.m.can_allocate("a", 4, watermark=0.9)
    assert not x.m.can_allocate("a", 4, watermark=0.0)  # pool exhausted
    x.sync()


def test_the_cache_imports_without_torch():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None\n"
            "import kvscope.engine.cache, kvscope.engine.bench.blocks\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=".")


def test_fork_gives_the_child_private_blocks_for_lookahead_slots():
    x = Mirrored(8, 4)
    x.m.add_sequence("p", [1, 2, 3, 4, 5])
    x.m.allocate_slots("p", 12)  # slots reserved ahead: positions 5..11 have no ids yet
    x.sync()
    x.m.fork("p", "c")
    ev = x.sync()
    # Block 0 (full, known) is shared; block 1 holds computed position 4 and is copied;
    # block 2 holds only future positions: a fresh block, nothing to copy.
    assert x.m.block_table("p") == [0, 1, 2] and x.m.block_table("c") == [0, 3, 4]
    assert x.m.take_copy_orders() == [(1, 3)]
    assert [e for e in ev if e["kind"] == "cow"] == [
        {"kind": "cow", "tier": "gpu", "seq": "c", "logical": [1, 2], "src": [1, 2],
         "dst": [3, 4]}
    ]
    assert x.m.metrics()["cow_copies"] == 1
    x.m.append_token_ids("c", [9, 9])  # each fills its own slots
    x.m.append_token_ids("p", [8, 8])
    x.sync()


def test_fork_with_lookahead_needs_free_blocks_or_changes_nothing():
    import pytest

    from kvscope.engine.cache import CacheError

    x = Mirrored(3, 4)
    x.m.add_sequence("p", [1, 2, 3, 4, 5])
    x.m.allocate_slots("p", 12)
    x.sync()
    snap = x.m.snapshot()
    with pytest.raises(CacheError, match="lookahead"):
        x.m.fork("p", "c")
    assert x.m.snapshot() == snap and "c" not in x.m and x.sync() == []


def test_a_sink_set_after_construction_receives_every_kind():
    # The manager's work is spread over helpers (tiers, prefix index, allocator): setting
    # ``sink`` must re-point them all, as it did when the manager emitted everything.
    from kvscope.engine.events.sink import ListSink

    m = KVCacheManager(8, 2)
    m.sink = sink = ListSink()
    m.add_sequence("a", [1, 2, 3, 4, 5])
    m.allocate_slots("a", 5)  # alloc, then store of the two full blocks
    m.fork("a", "b")
    m.free("a")
    m.add_sequence("c", [1, 2, 3, 4, 9])
    m.match_prefix("c")  # hit
    assert [e["kind"] for e in sink.drain()] == [
        "seq_add", "alloc", "store", "seq_add", "fork", "free", "seq_add", "hit"]
