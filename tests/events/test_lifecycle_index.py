"""LifecycleIndex over synthetic streams: incremental equals whole, a late joiner adopts
the running sequences, block lists may be numpy arrays, bad events are skipped without
losing the rest, and the cause text reads right."""

from __future__ import annotations

import copy

import numpy as np

from kvscope.engine.events import KVState
from kvscope.engine.events import causes as C
from kvscope.engine.events.analysis.lifecycle import PHASES, LifecycleIndex
from tests.inspector.batches import synthetic_batches


def _batches(n: int = 250) -> list[dict]:
    return synthetic_batches(n, seed=5, gpu_blocks=256, cpu_blocks=64, max_running=12,
                             arrival_rate=0.8)


def _summary(idx: LifecycleIndex) -> dict:
    return {sid: ([(p.kind, p.start_step, p.end_step) for p in s.phases], s.finish_step,
                  len(s.preemptions), s.prefill_tokens, s.recomputed_tokens, s.hit_tokens)
            for sid, s in idx.seqs.items()}


def test_incremental_equals_whole_and_phases_are_valid():
    batches = _batches()
    whole = LifecycleIndex.from_batches(batches)
    live = LifecycleIndex()
    for b in batches:
        live.add(b)
        live.add(b)  # a replayed (older or equal) step is ignored
    assert _summary(live) == _summary(whole)
    assert len(whole.steps["step"]) == len(batches)
    for s in whole.seqs.values():
        assert s.phases and all(p.kind in PHASES for p in s.phases)
        ends = [p.end_step for p in s.phases[:-1]]
        starts = [p.start_step for p in s.phases[1:]]
        assert ends == starts  # phases tile the life without gaps or overlaps
    assert sum(len(s.preemptions) for s in whole.seqs.values()) == \
        int(whole.steps["preemptions"].sum()) > 0


def test_numpy_and_packed_block_ids_give_the_same_index():
    batches = _batches(120)
    want = _summary(LifecycleIndex.from_batches(batches))
    for pack in (lambda v: np.asarray(v, dtype=np.int32),
                 lambda v: np.asarray(v, dtype="<i4").tobytes()):  # protocol 2's wire form
        packed = copy.deepcopy(batches)
        for b in packed:
            for ev in b["events"]:
                for key in ("blocks", "src", "dst"):
                    if key in ev:
                        ev[key] = pack(ev[key])
        assert _summary(LifecycleIndex.from_batches(packed)) == want


def test_late_joiner_adopts_running_sequences():
    batches = _batches()
    whole = LifecycleIndex.from_batches(batches)
    join = 120
    state = KVState()
    for b in batches[: join + 1]:
        state.apply(b)
    late = LifecycleIndex()
    assert late.adopt(state) == len(state.seqs) > 0
    for b in batches[join + 1:]:
        late.add(b)
    for sid in state.seqs:
        assert late.seqs[sid].finish_step == whole.seqs[sid].finish_step
        assert late.seqs[sid].phases[0].detail == "joined here"


def test_malformed_events_are_skipped_not_fatal():
    batches = _batches(60)
    bad = copy.deepcopy(batches)
    bad[30]["events"].insert(0, {"kind": "alloc", "tier": "gpu", "seq": "nobody",
                                 "blocks": [1]})
    bad[31]["events"].insert(0, {"kind": "seq_tokens", "seqs": ["ghost"], "num_tokens": [3]})
    bad[32]["events"].insert(0, "not an event")
    bad[33]["stats"] = "not a map"
    assert _summary(LifecycleIndex.from_batches(bad)) == \
        _summary(LifecycleIndex.from_batches(batches))


def test_cause_text():
    cause = {C.NEEDED_BY: "req88", C.BLOCKS_NEEDED: 6, C.FREE_BLOCKS: 0,
             C.POLICY: C.PREEMPT_RULE, C.REASON: C.R_ALLOCATE}
    assert C.describe(cause) == ("req88 needed 6 blocks, 0 free; victim: lowest priority, "
                                 "latest arrival (not yet scheduled this step)")
    assert C.describe({C.POLICY: "lfu", C.REASON: C.R_RESET}, "evict") == \
        "prefix cache reset; victim: least frequently used (LFU with dynamic aging)"
    assert C.describe(cause, victim="req88").startswith("req88 (itself) needed 6 blocks")
    assert C.describe(None) == "cause not recorded"
    assert C.describe("junk") == "cause not recorded"
