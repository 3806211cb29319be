"""The synthetic workload only emits valid sequences, and KVState.apply stays atomic
(undo log) when any event of a batch is rejected."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvscope.engine.bench.synthetic import SyntheticCache
from kvscope.engine.events import KVState, ListSink, ProtocolError
from kvscope.engine.events.state import unpack_ids

ALL_KINDS = {"tier_init", "seq_add", "seq_start", "alloc", "hit", "store", "evict", "free",
             "fork", "cow", "seq_tokens", "seq_preempt", "seq_resume", "seq_finish",
             "swap_out", "swap_in", "offload", "host_hit"}


def batches(seed: int, steps: int, **kw) -> tuple[SyntheticCache, list[dict]]:
    gen, sink, out = SyntheticCache(seed=seed, **kw), ListSink(), []
    for step in range(steps):
        stats = gen.step(sink)
        out.append({"v": 1, "step": step, "time": float(step), "events": sink.drain(),
                    "stats": stats})
    return gen, out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_workload_is_valid_and_covers_every_kind(seed):
    gen, sink, st, kinds = SyntheticCache(seed=seed), ListSink(), KVState(), set()
    for step in range(300):
        stats = gen.step(sink)
        events = sink.drain()
        kinds.update(e["kind"] for e in events)
        st.apply({"v": 1, "step": step, "events": events, "stats": stats})
        assert st.canonical() == gen.canonical(), f"diverged at step {step}"
    assert kinds == ALL_KINDS


def test_same_seed_same_events():
    assert batches(5, 50)[1] == batches(5, 50)[1]
    assert batches(5, 50)[1] != batches(6, 50)[1]


def _bad_event(st: KVState, rng: random.Random) -> dict:
    """An event that cannot apply to ``st`` (each kind of mistake a peer could make)."""
    holder = next((s for s in st.seqs.values() if s.block_table), None)
    options = [
        {"kind": "alloc", "tier": "gpu", "seq": "no-such-seq", "blocks": [0]},
        {"kind": "evict", "tier": "gpu", "blocks": [10**9]},
        {"kind": "free", "tier": "tpu", "seq": "x", "blocks": []},
        {"kind": "alloc"},  # fields missing
        {"kind": "seq_tokens", "seqs": ["a", "b"], "num_tokens": [1]},
        {"kind": "store", "tier": "gpu", "blocks": ["zero"], "hashes": [1]},
    ]
    if holder is not None:  # finishing a sequence that still holds blocks
        options.append({"kind": "seq_finish", "seq": holder.seq_id, "reason": "stop"})
    return rng.choice(options)


def _full(st: KVState) -> dict:
    """snapshot() with each tier's hash map as a dict (its order carries no meaning)."""
    snap = st.snapshot()
    for name, t in snap["tiers"].items():
        t["hashes"] = dict(zip(unpack_ids(t.pop("hashed")),
                               np.frombuffer(t["hashes"], "<i8").tolist(), strict=True))
        # and the display-only columns (owner, last change, per-block format)
        tier = st.tiers[name]
        t["columns"] = [c.np.tolist() for c in tier.columns()]
    return snap


def test_rejected_batch_leaves_state_unchanged():
    """A valid prefix of a batch followed by one bad event: nothing of it sticks."""
    rng = random.Random(7)
    _, good = batches(3, 200)
    st = KVState()
    for b in good[:60]:
        st.apply(b)
    checked = 0
    for b in good[60:]:
        before, snap = st.canonical(), _full(st)
        if b["events"]:
            cut = rng.randrange(len(b["events"]) + 1)
            bad = {**b, "events": b["events"][:cut] + [_bad_event(st, rng)]}
            with pytest.raises(ProtocolError):
                st.apply(bad)
            assert st.canonical() == before
            assert _full(st) == snap  # also counters, priorities, sequence order
            checked += 1
        st.apply(b)  # and the good batch still applies afterwards
    assert checked > 100


def test_unknown_kinds_and_fields_are_ignored():
    st = KVState()
    st.apply({"v": 1, "step": 0, "events": [
        {"kind": "tier_init", "tier": "gpu", "num_blocks": 4, "block_size": 16, "x": 1},
        {"kind": "teleport", "blocks": [1]}]})
    assert st.unknown_kinds == 1 and st.tiers["gpu"].num_blocks == 4


def test_snapshot_and_canonical_round_trips():
    gen, bs = batches(4, 150)
    st = KVState()
    for b in bs:
        st.apply(b)
    assert KVState.from_snapshot(st.snapshot()).canonical() == gen.canonical()
    assert KVState.from_canonical(gen.canonical()).canonical() == gen.canonical()


def test_clone_reusing_the_last_frame_equals_a_full_clone():
    """What the live inspector does each tick: each frame is built from the previous
    one (shared unchanged parts, changed blocks copied in place), yet equals a full copy;
    the mirror never shares anything with a frame."""
    _, bs = batches(9, 170)
    # twin: the same stream in a second mirror, cloned in full for the reference (a full
    # clone of st itself would make the next frame a full copy, not the in-place path)
    st, twin, frame, frames = KVState(), KVState(), None, []
    for i, b in enumerate(bs[:160]):
        st.apply(b)
        twin.apply(b)
        if i % 3 == 0:
            frame = st.clone(reuse=frame)
            full = twin.clone()
            assert frame.canonical() == full.canonical() == st.canonical()
            assert _full(frame) == _full(full)
            frames.append((frame, frame.canonical()))
    last, canon = frames[-1]  # the frame in use: later batches do not leak into it
    for b in bs[160:]:
        st.apply(b)
    assert last.canonical() == canon != st.canonical()
    assert st.clone(reuse=last).canonical() == st.canonical()
