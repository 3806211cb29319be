"""A mirror is bounded by construction (issue 49, defects 2 and 3): a batch's declared
geometry over all tiers and groups (``MAX_TOTAL_BLOCKS``), the live sequences
(``MAX_SEQS``) and a snapshot's declared size are each refused before anything is
allocated, with a clear message and the state exactly as before; the columnar apply
refuses the same batches with the same message."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from kvscope.engine.events import KVState, ProtocolError, state_handlers
from kvscope.engine.events import schema as S
from kvscope.engine.events.state import MAX_SEQS, MAX_TIER_BLOCKS, MAX_TOTAL_BLOCKS
from tests.events.test_columns import apply_both, full_state


def _batch(events: list[dict], step: int = 0) -> dict:
    return {"v": S.PROTOCOL_VERSION, "step": step, "events": events}


def _every_pool(num_blocks: int) -> list[dict]:
    """tier_init for every tier x cache group 0-63 (192 pools), each ``num_blocks``."""
    return [{"kind": "tier_init", "tier": t, "group": g, "num_blocks": num_blocks,
             "block_size": 16} for t in S.TIERS for g in range(64)]


def _started() -> KVState:
    st = KVState()
    st.apply(_batch([{"kind": "tier_init", "tier": "gpu", "num_blocks": 64, "block_size": 4},
                     {"kind": "seq_add", "seq": "a"},
                     {"kind": "alloc", "tier": "gpu", "seq": "a", "blocks": [1, 2]}]))
    return st


def test_a_batch_past_the_total_is_refused_before_allocating() -> None:
    """192 pools (3 tiers x 64 groups) each far below the per-pool cap, together past
    the total (today's code built all of them): refused before any pool is built (the
    tiers are the very same objects after), the message naming the limit. The issue's
    own batch, every pool at the cap, is below, in a process of its own."""
    per_pool = MAX_TOTAL_BLOCKS // 192 + 1
    st = _started()
    before, tiers = full_state(st), dict(st.tiers)
    with pytest.raises(ProtocolError, match=f"at most {MAX_TOTAL_BLOCKS} blocks over all"):
        st.apply(_batch(_every_pool(per_pool), step=1))
    assert full_state(st) == before
    assert st.tiers == tiers and all(st.tiers[n] is t for n, t in tiers.items())


def test_the_total_counts_the_pools_a_batch_keeps_and_a_pool_declared_twice() -> None:
    st = KVState()
    half = MAX_TOTAL_BLOCKS // 2
    st.apply(_batch([{"kind": "tier_init", "tier": "gpu", "num_blocks": half,
                      "block_size": 16}]))
    cpu = {"kind": "tier_init", "tier": "cpu", "num_blocks": half, "block_size": 16}
    with pytest.raises(ProtocolError, match="batch refused"):  # gpu kept: half + half + 1
        st.apply(_batch([cpu, {**cpu, "tier": "disk", "num_blocks": 1}], step=1))
    with pytest.raises(ProtocolError, match="batch refused"):  # cpu twice
        st.apply(_batch([{**cpu, "num_blocks": 1}, cpu], step=1))
    assert set(st.tiers) == {"gpu"}
    # re-declaring the pool it replaces is within the total (exactly at it)
    st.apply(_batch([{**cpu, "tier": "gpu", "num_blocks": half}, cpu], step=1))
    assert sum(t.num_blocks for t in st.tiers.values()) == MAX_TOTAL_BLOCKS


def test_the_columnar_apply_refuses_the_same_geometry() -> None:
    ref, fast = _started(), _started()
    per_pool = MAX_TOTAL_BLOCKS // 192 + 1
    events = _every_pool(per_pool) + [{"kind": "alloc", "tier": "gpu", "seq": "a",
                                       "blocks": list(range(3, 40))}]
    apply_both(ref, fast, _batch(events, step=1))
    assert full_state(ref) == full_state(_started())


def test_a_seq_add_flood_past_the_limit_is_refused_and_leaves_the_state() -> None:
    """One batch of MAX_SEQS + 1 sequences (today's code took them all): refused at the
    one past the limit, every one before it taken back."""
    st = _started()
    before = full_state(st)
    flood = [{"kind": "seq_add", "seq": f"s{i}"} for i in range(MAX_SEQS)]
    with pytest.raises(ProtocolError, match=f"limit of {MAX_SEQS} live sequences"):
        st.apply(_batch(flood, step=1))
    assert full_state(st) == before and len(st.seqs) == 1


def test_the_limit_holds_across_batches_on_both_paths(monkeypatch) -> None:
    """Batch after batch of seq_add: the mirror stops at the limit, each batch that
    would pass it refused (the same error on the columnar path), and a finished sequence
    makes room again."""
    monkeypatch.setattr(state_handlers, "MAX_SEQS", 100)
    ref, fast = _started(), _started()
    for k in range(3):  # 1 + 40 + 40 = 81 fit; the third batch would make 121
        apply_both(ref, fast, _batch([{"kind": "seq_add", "seq": f"{k}.{i}"}
                                      for i in range(40)], step=k + 1))
    assert len(ref.seqs) == 81
    apply_both(ref, fast, _batch([{"kind": "seq_add", "seq": f"x{i}"} for i in range(19)]
                                 + [{"kind": "seq_finish", "seq": "0.0"},
                                    {"kind": "seq_add", "seq": "y"}], step=9))
    assert len(ref.seqs) == 100
    with pytest.raises(ProtocolError, match="limit of 100 live sequences"):
        ref.apply(_batch([{"kind": "seq_add", "seq": "z"}], step=10))


def test_a_snapshot_past_the_limits_is_refused_before_building() -> None:
    snap = KVState().snapshot()
    snap["tiers"] = {f"gpu/{g}": {"num_blocks": MAX_TIER_BLOCKS, "block_size": 16,
                                  "format": "auto", "ref": b"", "hashed": b"",
                                  "hashes": b""} for g in range(64)}
    with pytest.raises(ProtocolError, match="64 tiers declare"):
        KVState.from_snapshot(snap)
    snap = KVState().snapshot()
    snap["seqs"] = [{"seq": f"s{i}"} for i in range(MAX_SEQS + 1)]
    with pytest.raises(ProtocolError, match=f"at most {MAX_SEQS} live sequences"):
        KVState.from_snapshot(snap)


_PEAK = textwrap.dedent("""
    import json, resource, sys
    from kvscope.engine.events import KVState, ProtocolError
    from kvscope.engine.events import schema as S
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # today's code: MemoryError
    base_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    st = KVState()
    pools = [{"kind": "tier_init", "tier": t, "group": g, "num_blocks": 1 << 22,
              "block_size": 16} for t in S.TIERS for g in range(64)]
    try:
        st.apply({"v": S.PROTOCOL_VERSION, "step": 0, "events": pools})
        out = "applied"
    except ProtocolError as e:
        out = str(e)
    except MemoryError:
        out = "MemoryError"
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(json.dumps({"out": out, "base_mib": base_mib, "peak_mib": peak_mib}))
""")


def test_the_hostile_geometry_batch_keeps_a_consumer_flat() -> None:
    """The issue's batch in a fresh process (its memory capped, so that code without
    the bound fails here instead of taking the machine): refused, the peak RSS within a
    few MiB of what the imports took."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _PEAK], capture_output=True, text=True,
                       env=env, timeout=120, check=True)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert "batch refused" in got["out"], got
    assert got["peak_mib"] - got["base_mib"] < 32, got


def test_the_routers_prefix_index_turns_off_past_its_limit_and_back_on(monkeypatch) -> None:
    """The router's index of a replica's mirror holds at most MAX_INDEXED blocks: past
    it, empty and saying why (the replica matches no prefix); back within it once the
    mirror's cached blocks are, rebuilt equal to the mirror."""
    from kvscope.engine.router import prefix_index as P

    monkeypatch.setattr(P, "MAX_INDEXED", 20)
    st, index = KVState(), P.PrefixIndex()

    def step(events: list[dict]) -> None:
        b = _batch(events, step=st.step + 1)
        st.apply(b)
        index.on_batch(b, st)

    step([{"kind": "tier_init", "tier": "gpu", "num_blocks": 64, "block_size": 4}])
    step([{"kind": "store", "tier": "gpu", "blocks": list(range(15)),
           "hashes": list(range(1000, 1015))}])
    assert len(index) == 15 and index.overflowed is None
    step([{"kind": "store", "tier": "gpu", "blocks": list(range(15, 25)),
           "hashes": list(range(2000, 2010))}])
    assert len(index) == 0 and index.matched_blocks([1000]) == 0
    assert index.overflowed is not None and "past its limit of 20" in index.overflowed
    rebuilt = P.PrefixIndex()
    rebuilt.rebuild(st)
    assert rebuilt.overflowed is not None and len(rebuilt) == 0
    step([{"kind": "evict", "tier": "gpu", "blocks": list(range(15, 25))}])
    assert index.overflowed is None and len(index) == 15
    assert dict(index.count) == {h: 1 for h in range(1000, 1015)}
