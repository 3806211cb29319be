"""The hybrid cache's sliding-window group (engine.cache.window_group): blocks that fell out
of every window are released, the bound holds, forks share, errors change nothing."""

from __future__ import annotations

import random

import pytest

from kvscope.engine.cache import KVCacheManager
from kvscope.engine.cache.errors import CacheError
from kvscope.engine.cache.window_group import RELEASED
from kvscope.engine.events import schema as S
from tests.cache.conftest import Mirrored, kinds


def _manager(window: int = 48, bs: int = 16, gpu: int = 64, win: int = 16) -> KVCacheManager:
    return KVCacheManager(gpu, bs, enable_prefix_caching=False, window=window,
                          num_window_blocks=win)


def test_long_decode_keeps_window_blocks_bounded_and_full_group_grows():
    m = _manager(window=48, bs=16, gpu=64, win=8)
    m.add_sequence("a", list(range(40)))
    assert m.allocate_slots("a", 40) is not None
    m.start("a")
    bound = -(-48 // 16) + 1
    peak = 0
    for t in range(600):
        assert m.allocate_slots("a", 1) is not None
        m.append_token_ids("a", [t % 50])
        s = m.sequences["a"]
        peak = max(peak, m.window.held(s))
        assert m.window.held(s) <= bound
        m.check_invariants()
    s = m.sequences["a"]
    assert len(s.block_table) == -(-640 // 16)  # the full-attention group keeps everything
    assert peak == bound
    assert s.window_table[:s.window_first] == [RELEASED] * s.window_first
    # the kernels' table: released entries read block 0, the rest are held blocks
    rt = m.window_table("a")
    assert len(rt) == len(s.block_table) and rt[s.window_first:] == s.window_table[s.window_first:]


def test_window_slots_cover_the_last_window_and_differ_from_group_0():
    m = _manager(window=20, bs=4, gpu=32, win=16)
    m.add_sequence("a", list(range(30)))
    slots = m.allocate_slots("a", 30)
    wslots = m.window_slots("a", 0, 30)
    assert len(slots) == len(wslots) == 30
    assert m.allocate_slots("a", 1) == [m.block_table("a")[-1] * 4 + 2]
    # positions 11..30 are inside the window of the query at 30: their blocks are held
    s = m.sequences["a"]
    assert s.window_first <= 11 // 4
    assert m.window_slots("a", 30, 31)[0] // 4 == s.window_table[-1]


def test_window_pool_exhaustion_refuses_the_allocation_and_changes_nothing():
    m = _manager(window=64, bs=16, gpu=64, win=3)
    m.add_sequence("a", list(range(40)))
    assert m.can_allocate("a", 40)
    m.allocate_slots("a", 40)  # 3 window blocks
    m.add_sequence("b", list(range(20)))
    assert not m.can_allocate("b", 20)
    assert m.allocate_slots("b", 20) is None
    assert m.block_table("b") == [] and m.sequences["b"].window_table == []
    m.finish("a", "stop")
    assert m.window.pool.num_free_blocks == 3
    assert m.allocate_slots("b", 20) is not None
    m.check_invariants()


def test_fork_shares_window_blocks_and_copies_the_partial_one_on_write():
    x = Mirrored(32, 4, enable_prefix_caching=False, window=16, num_window_blocks=16)
    m = x.m
    m.add_sequence("p", list(range(10)))
    m.allocate_slots("p", 10)
    m.start("p")
    m.fork("p", "c")
    x.sync()
    m.append_token_ids("c", [7])
    m.allocate_slots("c", 1)  # into the shared partial block: copy-on-write in both groups
    assert len(m.take_copy_orders()) == 1
    w = m.take_window_copy_orders()
    assert len(w) == 1 and w[0][0] == m.sequences["p"].window_table[-1]
    x.sync()
    assert x.state.seqs["c"].group_tables[1][-1] == w[0][1]
    m.preempt("p")
    m.finish("c", "stop")
    x.sync()
    assert m.window.pool.num_free_blocks == 16


@pytest.mark.parametrize("seed", [5, 6])
def test_random_workload_keeps_the_invariants_and_the_event_mirror(seed):
    """Random adds, prefills, decodes, forks, preemptions: after every operation the
    invariants hold and the KVState rebuilt from the events (group 1's pool and tables
    included) equals the manager's snapshot."""
    rng = random.Random(seed)
    x = Mirrored(80, 4, enable_prefix_caching=False, window=24, num_window_blocks=30)
    m = x.m
    live: list[str] = []
    decoding: set[str] = set()  # last allocation was one token: the decode bound holds
    for i in range(400):
        op = rng.random()
        if op < 0.2 or not live:
            sid = f"s{i}"
            m.add_sequence(sid, [rng.randrange(50) for _ in range(rng.randint(1, 30))])
            n = len(m.sequences[sid].token_ids)
            if m.allocate_slots(sid, n) is None:
                m.finish(sid, "abort")
            else:
                m.start(sid)
                live.append(sid)
        elif op < 0.3:
            sid = live.pop(rng.randrange(len(live)))
            m.finish(sid, "stop")
        elif op < 0.35 and len(live) < 8:
            c = f"f{i}"
            try:
                m.fork(rng.choice(live), c)
                live.append(c)
            except CacheError:
                pass
        else:
            sid = rng.choice(live)
            if m.allocate_slots(sid, 1) is None:
                m.preempt(sid)
                m.free(sid)
                m.finish(sid, "abort")
                live.remove(sid)
            else:
                m.append_token_ids(sid, [rng.randrange(50)])
                decoding.add(sid)
        m.take_window_copy_orders()
        x.sync()  # check_invariants, and mirror == snapshot
        for sid in decoding & set(live):
            s = m.sequences[sid]
            assert m.window.held(s) <= -(-24 // 4) + 1


@pytest.mark.parametrize("kw", [
    # a cpu tier needs a host pool for each group
    {"window": 8, "num_window_blocks": 4, "num_cpu_blocks": 4},  # prefix caching on
    {"enable_prefix_caching": False, "window": 8, "num_window_blocks": 4, "num_cpu_blocks": 4},
    {"window": 8, "num_window_blocks": 4, "num_window_cpu_blocks": 4},
    # no disk tier: the cpu tier is swap space only beside a window group
    {"window": 8, "num_window_blocks": 4, "num_cpu_blocks": 4, "num_window_cpu_blocks": 2,
     "num_disk_blocks": 4},
    {"enable_prefix_caching": False, "window": 8, "num_window_blocks": 0},
    {"enable_prefix_caching": False, "window": 0, "num_window_blocks": 4},
])
def test_unsupported_window_groups_are_refused(kw):
    with pytest.raises(CacheError):
        KVCacheManager(16, 4, **kw)


def test_hybrid_bench_fits_more_sequences_in_one_budget():
    """`kvscope bench hybrid`, small: the windowed group's saving shows in bytes per
    sequence and in sequences per budget; the pools stay within the budget."""
    import argparse

    from kvscope.engine.bench.hybrid import measure

    args = argparse.Namespace(context=2048, chunk=512, decode=16, budget_gib=0.125,
                              block_size=16)
    gemma = measure("gemma-3-1b", args)
    assert gemma["window_blocks_held"] <= 512 // 16 + 1
    assert gemma["bytes_ratio"] > 2 and gemma["hybrid_seqs"] >= 2 * gemma["keep_seqs"] > 0
    # a swap preemption copies what the sequence holds: the same saving
    assert gemma["hybrid_swap_bytes"] == gemma["hybrid_bytes_per_seq"] < gemma["keep_swap_bytes"]
    assert gemma["hybrid_pools_bytes"] <= 0.125 * (1 << 30)
    # prefix caching on both sides: the hybrid hits as much of the shared prefix
    assert gemma["prefix_hybrid_seqs"] >= gemma["prefix_keep_seqs"] > 1
    assert gemma["prefix_hybrid_hit_rate"] >= gemma["prefix_keep_hit_rate"] > 0.5
    mistral = measure("mistral-7b", args)  # context < 2 W: little to release at 2k
    assert mistral["hybrid_seqs"] >= mistral["keep_seqs"]


def test_events_name_the_group_and_old_recordings_replay():
    """Group 1 has its own tier_init; releases are ``release`` events; events without a
    group (every recording before groups) mean group 0, as before."""
    x = Mirrored(32, 4, enable_prefix_caching=False, window=8, num_window_blocks=8)
    first = x.events
    assert [e.get("group", 0) for e in first if e["kind"] == S.TIER_INIT] == [0, 1]
    m = x.m
    m.add_sequence("a", list(range(10)))
    m.allocate_slots("a", 10)
    m.start("a")
    x.sync()
    for t in range(12):
        m.allocate_slots("a", 1)
        m.append_token_ids("a", [t])
    evs = x.sync()
    assert S.RELEASE in kinds(evs)
    assert all(e["group"] == 1 for e in evs if e["kind"] == S.RELEASE)
    assert x.state.seqs["a"].group_tables[1] == m.sequences["a"].window_table[
        m.sequences["a"].window_first:]
    assert "gpu/1" in x.state.tiers and x.state.tiers["gpu/1"].num_blocks == 8
    # a group-0-only stream (no group field anywhere) replays unchanged
    y = Mirrored(16, 4)
    y.m.add_sequence("b", [1, 2, 3])
    y.m.allocate_slots("b", 3)
    y.sync()
    assert all("group" not in e for e in y.events)
    assert "group_tables" not in y.state.canonical()["seqs"]["b"]


# ------------------------------------------------------------------ prefix caching
def _brute_longest(cached: set[int], k0: int, window: int, bs: int) -> int:
    """The hit rule spelled out: the largest k <= k0 whose last W tokens' window blocks,
    ``first_kept(k * bs - 1) .. k - 1``, are all cached."""
    for k in range(k0, 0, -1):
        lo = max(0, (k * bs - window) // bs)
        if all(j in cached for j in range(lo, k)):
            return k
    return 0


@pytest.mark.parametrize("window,bs", [(8, 4), (7, 4), (20, 4), (5, 1), (100, 16)])
def test_longest_hit_is_the_rule_checked_against_brute_force(window, bs):
    """Random sets of cached window blocks (some under a stale serial, which must count as
    missing): longest_hit returns the brute force's k and exactly the blocks covering the
    prefix's last W tokens."""
    rng = random.Random(window * 100 + bs)
    for _ in range(200):
        m = KVCacheManager(64, bs, window=window, num_window_blocks=40)
        pool = m.window.pool
        k0 = rng.randint(0, 30)
        chain = [(1000 + j, 5000 + j) for j in range(k0)]  # (hash, group-0 serial)
        cached, ids = set(), rng.sample(range(40), k0)
        for j in range(k0):
            r = rng.random()
            if r < 0.8:
                serial = chain[j][1] if r < 0.7 else -1  # -1: a stale entry, a miss
                pool.entry[ids[j]] = (chain[j][0], None, (0,) * bs, serial, 0)
                pool.cached[chain[j][0]] = ids[j]
                if serial != -1:
                    cached.add(j)
        k, blocks = m.window.longest_hit(chain)
        assert k == _brute_longest(cached, k0, window, bs)
        lo = max(0, (k * bs - window) // bs)
        assert blocks == [ids[j] for j in range(lo, k)] if k else blocks == []


def test_prefix_hit_shares_the_full_prefix_and_only_the_window_blocks_of_its_end():
    """A finished sequence's released window blocks stay cached; a later request with the
    same 7-block prefix (3.5 windows) hits group 0's 7 blocks and group 1's last two
    (positions 20..27 = its last W tokens), the entries before them released; events
    rebuild exactly this state (group-1 store, hit, evict)."""
    x = Mirrored(64, 4, window=8, num_window_blocks=12)
    m = x.m
    shared = list(range(100, 128))  # 28 tokens, 7 full blocks
    m.add_sequence("a", shared + [1, 2])
    m.allocate_slots("a", 30)
    m.start("a")
    x.sync()
    for t in range(6):  # decode past the prompt: blocks 0..6 leave the window, cached
        m.allocate_slots("a", 1)
        m.append_token_ids("a", [t])
        x.sync()
    assert m.sequences["a"].window_first == 7
    assert m.window.pool.num_cached_free_blocks == 7
    m.finish("a", "stop")
    x.sync()
    m.add_sequence("b", shared + [9, 9, 9])
    assert m.match_prefix("b") == 28
    evs = x.sync()
    b = m.sequences["b"]
    assert len(b.block_table) == 7
    assert b.window_first == 5 and b.window_table[:5] == [RELEASED] * 5
    hits = [e for e in evs if e["kind"] == S.HIT]
    assert [e.get("group", 0) for e in hits] == [0, 1] and len(hits[1]["blocks"]) == 2
    assert x.state.seqs["b"].group_tables[1] == b.window_table[5:]
    assert m.allocate_slots("b", 3) is not None  # the prompt's rest: computed, not hit
    m.start("b")
    x.sync()
    # a reset drops both groups' cached blocks (group-1 evict events)
    m.finish("b", "stop")
    x.sync()
    m.evict_cached()
    evs = x.sync()
    assert any(e["kind"] == S.EVICT and e.get("group") == 1 for e in evs)
    assert m.window.pool.num_cached_free_blocks == 0


def test_prefix_hit_shrinks_to_where_the_window_blocks_remain():
    """Group 0 still holds a 7-block prefix but the window blocks of its end were evicted
    (a small window pool reused them): the hit is the longest shorter prefix whose last W
    tokens' window blocks are cached, or none, and the tokens are then recomputed."""
    x = Mirrored(64, 4, window=8, num_window_blocks=12)
    m = x.m
    shared = list(range(100, 128))
    m.add_sequence("a", shared + [1])
    m.allocate_slots("a", 29)  # prefill: blocks 0..7 in both groups, 0..6 indexed
    m.start("a")
    m.finish("a", "stop")
    x.sync()
    # LRU of the window pool: the release walked the table backwards, so the tail goes
    # first: evicting four takes logical blocks 6, 5, 4, 3 (7, never indexed, is free)
    m.window.pool.evict(4)
    x.sync()
    cached = {j for j, b in enumerate(range(8)) if m.window.pool.entry[b] is not None}
    assert cached == {0, 1, 2}
    m.add_sequence("b", shared + [5])
    assert m.match_prefix("b") == 3 * 4  # k = 3: blocks 0..2 cover positions 4..11
    b = m.sequences["b"]
    assert len(b.block_table) == 3 and b.window_first == 1
    x.sync()
    assert m.allocate_slots("b", 29 - 12) is not None
    x.sync()


def test_group_0_eviction_takes_the_window_twins_out_of_the_index():
    """Group 0 evicts a content: its cached window blocks are dropped with it (event
    ``evict``, group 1, policy "twin"), so the same prompt computed again indexes its new
    window blocks under the hashes, and the request after it hits both groups."""
    x = Mirrored(6, 4, window=8, num_window_blocks=12)
    m = x.m
    prompt = list(range(13))
    for sid, toks in (("a", prompt), ("b", [50] * 24)):  # b's 6 blocks evict a's 3
        m.add_sequence(sid, toks)
        assert m.allocate_slots(sid, len(toks) - m.match_prefix(sid)) is not None
        m.finish(sid, "stop")
        evs = x.sync()
    twins = [e for e in evs if e["kind"] == S.EVICT and e.get("group") == 1]
    assert len(twins) == 1 and len(twins[0]["blocks"]) == 3
    assert twins[0]["cause"]["policy"] == "twin" and twins[0]["cause"]["needed_by"] == "b"
    m.add_sequence("c", prompt)
    assert m.match_prefix("c") == 0  # group 0 lost it: recomputed, stored again
    m.allocate_slots("c", 13)
    m.finish("c", "stop")
    x.sync()
    m.add_sequence("d", prompt)
    assert m.match_prefix("d") == 12
    x.sync()


@pytest.mark.parametrize("seed", [7, 8])
def test_random_workload_with_prefix_caching_keeps_the_mirror_and_the_bound(seed):
    """Random requests over a few shared prefixes longer than the window, admitted through
    match_prefix, decoded, preempted, forked and finished, with a window pool small enough
    to evict: invariants and mirror == snapshot after every operation, real group-1 hits,
    and the decode bound on held window blocks."""
    rng = random.Random(seed)
    x = Mirrored(80, 4, window=10, num_window_blocks=24)
    m = x.m
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(12, 26))] for _ in range(3)]
    live: list[str] = []
    decoding: set[str] = set()
    window_hits = 0
    for i in range(400):
        op = rng.random()
        if op < 0.2 or not live:
            sid = f"s{i}"
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 6))]
            m.add_sequence(sid, prompt)
            k = m.match_prefix(sid)
            if m.allocate_slots(sid, len(prompt) - k) is None:
                m.finish(sid, "abort")
            else:
                m.start(sid)
                live.append(sid)
        elif op < 0.3:
            m.finish(live.pop(rng.randrange(len(live))), "stop")
        elif op < 0.35 and len(live) < 8:
            try:
                m.fork(rng.choice(live), f"f{i}")
                live.append(f"f{i}")
            except CacheError:
                pass
        else:
            sid = rng.choice(live)
            if m.allocate_slots(sid, 1) is None:
                m.preempt(sid)
                m.finish(sid, "abort")
                live.remove(sid)
                decoding.discard(sid)
            else:
                m.append_token_ids(sid, [rng.randrange(50)])
                decoding.add(sid)
        m.take_window_copy_orders()
        m.take_copy_orders()
        evs = x.sync()
        window_hits += sum(1 for e in evs if e["kind"] == S.HIT and e.get("group") == 1)
        for sid in decoding & set(live):
            assert m.window.held(m.sequences[sid]) <= -(-10 // 4) + 1
    assert window_hits > 10 and m.window.pool.num_evictions > 0


class _Pages:
    """A simulated runner for a hybrid cache with a cpu tier: each group's gpu and host
    slots hold the digest of the prefix their position was computed from; the manager's
    swap rounds (both groups) and copy-on-write orders are executed as the runner does
    (a batch gathers, then scatters)."""

    def __init__(self, m: KVCacheManager) -> None:
        self.m, self.bs = m, m.block_size
        self.kv = {(g, t): {} for g in (0, 1) for t in ("gpu", "cpu")}

    def run_orders(self) -> int:
        m, bs, kv = self.m, self.bs, self.kv
        moved = 0
        for g, rounds in ((0, m.take_swap_rounds()), (1, m.take_window_swap_rounds())):
            for outs, ins in rounds:
                for pairs, a, b in ((outs, "gpu", "cpu"), (ins, "cpu", "gpu")):
                    got = [[kv[g, a].get(x * bs + o) for o in range(bs)] for x, _ in pairs]
                    for (_, y), vals in zip(pairs, got, strict=True):
                        for o, v in enumerate(vals):
                            kv[g, b][y * bs + o] = v
                    moved += len(pairs) * g
        for g, orders in ((0, m.take_copy_orders()), (1, m.take_window_copy_orders())):
            got = [[kv[g, "gpu"].get(x * bs + o) for o in range(bs)] for x, _ in orders]
            for (_, y), vals in zip(orders, got, strict=True):
                for o, v in enumerate(vals):
                    kv[g, "gpu"][y * bs + o] = v
        return moved

    def compute(self, sid: str, start: int, slots: list[int]) -> None:
        """The forward of positions [start, start + len(slots)): both groups' K/V."""
        self.run_orders()
        s = self.m.sequences[sid]
        wslots = self.m.window_slots(sid, start, start + len(slots))
        for p, x, w in zip(range(start, start + len(slots)), slots, wslots, strict=True):
            d = hash(tuple(s.token_ids[:p + 1]))
            self.kv[0, "gpu"][x], self.kv[1, "gpu"][w] = d, d

    def check(self) -> None:
        """Every computed position reads its own prefix's digest: group 0 over the whole
        table, group 1 over its held blocks, on the tier the sequence is in."""
        self.run_orders()
        bs = self.bs
        for s in self.m.sequences.values():
            if s.status == "waiting":
                continue
            for p in range(s.num_tokens):
                d = hash(tuple(s.token_ids[:p + 1]))
                assert self.kv[0, s.tier].get(s.block_table[p // bs] * bs + p % bs) == d
                if p // bs >= s.window_first:
                    assert self.kv[1, s.tier].get(s.window_table[p // bs] * bs + p % bs) == d


@pytest.mark.parametrize("seed", [11, 12])
def test_swap_preemption_moves_both_groups_and_keeps_the_mirror(seed):
    """Random admissions (with prefix hits), decodes, forks, swap and recompute
    preemptions, swap-ins and finishes of swapped sequences, with host pools small enough
    that some swaps fall back to recompute: after every operation the invariants hold,
    the mirror equals the snapshot (group 1's host pool and tables included), and every
    computed position of every sequence, on the gpu or swapped out, holds its own K/V in
    both groups (the simulated runner executes the swap rounds of each group)."""
    rng = random.Random(seed)
    x = Mirrored(60, 4, window=10, num_window_blocks=30, num_cpu_blocks=40,
                 num_window_cpu_blocks=12)
    m, pages = x.m, _Pages(x.m)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(12, 26))] for _ in range(3)]
    running: list[str] = []
    swapped: list[str] = []
    moved = swaps = fallbacks = 0
    for i in range(400):
        op = rng.random()
        if op < 0.15 or not running and not swapped:
            sid = f"s{i}"
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 6))]
            m.add_sequence(sid, prompt)
            k = m.match_prefix(sid)
            slots = m.allocate_slots(sid, len(prompt) - k)
            if slots is None:
                m.finish(sid, "abort")
            else:
                pages.compute(sid, k, slots)
                m.append_token_ids(sid, [rng.randrange(50)])  # its first sampled token
                m.start(sid)
                running.append(sid)
        elif op < 0.22 and running:
            sid = running.pop(rng.randrange(len(running)))
            mode = m.preempt(sid, "swap")
            if mode == "swap":
                swaps += 1
                swapped.append(sid)
                assert m.sequences[sid].tier == "cpu"
            else:
                fallbacks += 1
                m.finish(sid, "abort")
        elif op < 0.32 and swapped:
            sid = swapped[0]
            if m.can_swap_in(sid, 1):
                assert m.swap_in(sid)
                swapped.pop(0)
                running.append(sid)
                s = m.sequences[sid]
                slots = m.allocate_slots(sid, 1)
                assert slots is not None  # can_swap_in promised the room
                pages.compute(sid, s.num_tokens - 1, slots)
                m.append_token_ids(sid, [rng.randrange(50)])
        elif op < 0.36 and (running or swapped):
            pool = running if running and (not swapped or rng.random() < 0.5) else swapped
            m.finish(pool.pop(rng.randrange(len(pool))), "stop")
        elif op < 0.4 and running and len(running) < 8:
            try:
                m.fork(rng.choice(running), f"f{i}")
                running.append(f"f{i}")
            except CacheError:
                pass
        elif running:
            sid = rng.choice(running)
            start = m.sequences[sid].num_tokens
            slots = m.allocate_slots(sid, 1)
            if slots is None:
                running.remove(sid)
                if m.preempt(sid, "swap") == "swap":
                    swapped.append(sid)
                else:
                    m.finish(sid, "abort")
            else:
                pages.compute(sid, start, slots)
                m.append_token_ids(sid, [rng.randrange(50)])
        moved += pages.run_orders()
        pages.check()
        x.sync()
        for sid in running:  # a swapped-in sequence holds no more than a decoding one
            if m.sequences[sid].num_tokens > m.sequences[sid].num_prompt_tokens:
                assert m.window.held(m.sequences[sid]) <= -(-10 // 4) + 1
    assert swaps > 10 and fallbacks > 0 and moved > 0
    assert any(e["kind"] == S.SWAP_IN and e.get("group") == 1 for e in x.events)
    assert "cpu/1" in x.state.tiers
