"""The columnar form (engine.events.columns) and its apply (engine.events.state_columns)
equal the reference ``KVState.apply`` on any stream: random streams of every kind the
schema declares (a kind added to the schema is drawn here without a change), the
synthetic workload, the demo's recording and the real cache manager's events."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.engine.bench.synthetic import SyntheticCache
from kvscope.engine.events import KVState, ListSink, ProtocolError, state_columns
from kvscope.engine.events import schema as S
from kvscope.engine.events import state as state_mod
from kvscope.engine.events.columns import OTHER, StepColumns
from kvscope.engine.events.state import pack_ids, unpack_ids

# ------------------------------------------------------------ comparing states


def full_state(s: KVState) -> dict:
    """Everything a state holds that a reader can see: the snapshot (tables, counters,
    priorities, sequence order, kind counts), every per-block column (owner, last
    change, format codes and names) and the unknown-kind count."""
    snap = s.snapshot()
    for name, t in snap["tiers"].items():
        tier = s.tiers[name]
        del t["hashed"]
        t["hashes"] = tier.hash_list()
        t["columns"] = [c.np.tolist() for c in tier.columns()]
        t["format_names"] = list(tier.format_names)
        t["big"] = dict(tier.big_hashes)
    snap["seq_order"] = list(s.seqs)
    snap["unknown"] = s.unknown_kinds
    return snap


def columnar(batch: dict) -> dict:
    """The batch with its events as columns, as a reader gets them off the wire (through
    ``to_wire``/``from_wire``: no source events to fall back on)."""
    out = {k: v for k, v in batch.items() if k != "events"}
    cols = StepColumns.from_events(batch["events"])
    out["columns"] = StepColumns.from_wire(cols.to_wire(), cols.others)
    return out


def apply_both(ref: KVState, fast: KVState, batch: dict) -> None:
    """Apply ``batch`` per event to ``ref`` and as columns to ``fast``: the same error
    (or none) and the same state after."""
    err_ref = err_fast = None
    try:
        ref.apply(batch)
    except ProtocolError as e:
        err_ref = str(e)
    try:
        fast.apply(columnar(batch))
    except ProtocolError as e:
        err_fast = str(e)
    assert err_fast == err_ref
    assert full_state(fast) == full_state(ref)


# ------------------------------------------------------- random schema events
SEQ_POOL = ["a", "b", "c", "s0", "s1", "s2", "s3"]
WORDS = sorted({*S.TIERS, *S.PREEMPT_MODES, *S.FINISH_REASONS, *S.KV_FORMATS, "tpu"})
MAX_BLOCK = 10  # tiers here hold 8 blocks: ids 8..10 are out of range
mi = msgspec.inspect


def _value(name: str, t: mi.Type) -> st.SearchStrategy:
    """A value for field ``name`` of type ``t``: drawn from the small worlds of this test
    (a few sequences, tiny tiers) so that random events often apply."""
    if isinstance(t, mi.UnionType):
        types = list(t.types)
        if name in S.BLOCK_ID_FIELDS:
            ids = st.lists(st.integers(0, MAX_BLOCK), max_size=4)
            return st.one_of(ids, ids.map(pack_ids))
        return st.one_of(*[_value(name, x) for x in types])
    if isinstance(t, mi.StrType):
        if name in ("seq", "parent"):
            return st.sampled_from(SEQ_POOL)
        if name == "tier":
            return st.sampled_from(S.TIERS + ("tpu",))
        return st.sampled_from(WORDS)
    if isinstance(t, mi.IntType):
        return st.integers(0, 8)
    if isinstance(t, mi.ListType):
        if name == "seqs":
            return st.lists(st.sampled_from(SEQ_POOL), max_size=4)
        if name == "hashes":
            return st.lists(st.one_of(st.integers(1, 6), st.just(1 << 70)), max_size=4)
        return st.lists(_value(name, t.item_type), max_size=4)
    if isinstance(t, mi.NoneType):
        return st.none()
    if isinstance(t, mi.StructType):
        return st.just({})
    return st.none()


@st.composite
def schema_event(draw: st.DrawFn) -> dict:
    """An event of any kind in the schema, its fields drawn from their declared types;
    sometimes its list fields cut to one length (so multi-list kinds can apply)."""
    kind = draw(st.sampled_from(S.EVENT_KINDS))
    ev: dict = {"kind": kind}
    for f in mi.type_info(S.EVENT_TYPES[kind]).fields:
        if f.required or draw(st.booleans()):
            ev[f.name] = draw(_value(f.name, f.type))
    lists = [k for k, v in ev.items() if isinstance(v, (list, bytes)) and k != "kind"]
    if len(lists) > 1 and draw(st.booleans()):
        n = min(len(unpack_ids(ev[k])) if k in S.BLOCK_ID_FIELDS else len(ev[k])
                for k in lists)
        for k in lists:
            ev[k] = (unpack_ids(ev[k])[:n] if k in S.BLOCK_ID_FIELDS else ev[k][:n])
    return ev


@pytest.fixture(params=["arrays", "mixed"])
def array_path(request, monkeypatch):
    """Run a test twice: with every hot sub-run on the array path (tiny test batches
    would otherwise all take the reference), and mixed: sub-runs of 3 ids or more on the
    array path, smaller ones through the reference in between (the default thresholds,
    on real-sized batches, are in tests/events/test_wire_v3.py)."""
    if request.param == "arrays":
        all_arrays(monkeypatch)
    else:
        monkeypatch.setattr(state_columns, "SMALL_RUN", 3)
        monkeypatch.setattr(state_columns, "BULK_IDS", 0)
    return request.param


def all_arrays(monkeypatch) -> None:
    """Every hot sub-run on the array path, whatever its size."""
    monkeypatch.setattr(state_columns, "SMALL_RUN", 0)
    monkeypatch.setattr(state_columns, "BULK_IDS", 0)


SETUP = [{"kind": "tier_init", "tier": t, "num_blocks": 8, "block_size": 4}
         for t in S.TIERS] + [{"kind": "seq_add", "seq": s} for s in SEQ_POOL[:4]]


@settings(max_examples=120, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(schema_event(), max_size=12), min_size=1, max_size=12))
def test_random_streams_of_every_kind_apply_the_same(array_path, steps):
    ref, fast = KVState(), KVState()
    apply_both(ref, fast, {"v": 2, "step": 0, "events": list(SETUP)})
    for i, events in enumerate(steps, 1):
        apply_both(ref, fast, {"v": 2, "step": i, "time": float(i), "events": events})


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), data=st.data())
def test_workload_with_random_events_spliced_in_applies_the_same(array_path, seed, data):
    """Valid, deep streams (the synthetic workload on small tiers), with random events
    of every kind inserted at random places: runs split around rare events and batches
    rejected midway must still agree."""
    gen, sink = SyntheticCache(seed=seed, gpu_blocks=8, cpu_blocks=8, max_running=4), ListSink()
    ref, fast = KVState(), KVState()
    for step in range(40):
        stats = gen.step(sink)
        events = sink.drain()
        if data.draw(st.booleans()):
            for ev in data.draw(st.lists(schema_event(), max_size=3)):
                events.insert(data.draw(st.integers(0, len(events))), ev)
        apply_both(ref, fast, {"v": 2, "step": step, "events": events, "stats": stats})


def test_schema_events_cover_every_kind():
    """The generator above draws each kind the schema declares (not a fixed list).
    Derandomized: 400 random draws missed a rare kind now and then (seen failing once in
    a run of the events tests), which a test about the generator's reach must not do."""
    seen = set()

    @settings(max_examples=400, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(schema_event())
    def draw(ev):
        seen.add(ev["kind"])

    draw()
    assert seen == set(S.EVENT_KINDS)


# ------------------------------------------------------------ real streams
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_synthetic_workload_applies_the_same(array_path, seed):
    gen, sink = SyntheticCache(seed=seed), ListSink()
    ref, fast = KVState(), KVState()
    for step in range(300):
        stats = gen.step(sink)
        apply_both(ref, fast, {"v": 2, "step": step, "events": sink.drain(), "stats": stats})
    assert fast.canonical() == gen.canonical()


def test_demo_recording_applies_the_same(array_path):
    from kvscope.engine.events.wire.recording import Recording

    ref, fast = KVState(), KVState()
    with Recording("assets/sample.kvtrace") as rec:
        n = 0
        for batch in rec:
            apply_both(ref, fast, batch)
            n += len(batch["events"])
    assert n > 1000


def test_columns_hold_the_hot_kinds_and_keep_the_rest_in_order():
    events = [
        {"kind": "alloc", "tier": "gpu", "seq": "a", "blocks": [1, 2]},
        {"kind": "seq_preempt", "seq": "a", "mode": "swap"},
        {"kind": "hit", "tier": "gpu", "seq": "b", "blocks": pack_ids([3])},
        {"kind": "store", "tier": "gpu", "blocks": [1], "hashes": [1 << 70]},  # too big
        {"kind": "evict", "tier": "cpu", "blocks": [4], "cause": {"policy": "lru"}},
        {"kind": "seq_tokens", "seqs": ["a", "b"], "num_tokens": [5, 6]},
        {"kind": "teleport"},
    ]
    cols = StepColumns.from_events(events)
    assert cols.kind.tolist() == [1, OTHER, 2, OTHER, 5, 6, OTHER]
    assert cols.others == [events[1], events[3], events[6]]
    assert cols.to_events() is events  # built from them: given back as they are
    cols.source = None  # as off the wire: rebuilt from the columns
    back = cols.to_events()
    assert back[2] == {**events[2], "blocks": [3], "tokens": 0}
    assert [back[i] for i in (0, 1, 3, 4, 5, 6)] == [events[i] for i in (0, 1, 3, 4, 5, 6)]
    again = StepColumns.from_events(back)
    for name in ("kind", "tier", "seq", "arg", "off", "ids", "vals"):
        assert np.array_equal(getattr(again, name), getattr(cols, name))


def test_wire_form_round_trips_and_refuses_bad_columns():
    events = [{"kind": "alloc", "tier": "gpu", "seq": "a", "blocks": [1, 2]},
              {"kind": "seq_tokens", "seqs": ["a"], "num_tokens": [7]},
              {"kind": "seq_finish", "seq": "a", "reason": "stop"}]
    cols = StepColumns.from_events(events)
    wire = cols.to_wire()
    assert StepColumns.from_wire(wire, cols.others).to_events() == events
    bad = [
        {**wire, "ids": wire["ids"][:-1]},  # ragged
        {**wire, "kind": b"\x09\x06\x00"},  # unknown code
        {**wire, "seq": np.array([5, -1, -1], "<i4").tobytes()},  # no such name
        {**wire, "off": np.array([0, 3, 3, 3], "<i4").tobytes()},  # past the ids
        {**wire, "vals": b""},  # seq_tokens without counts
        {**wire, "names": [1]},
    ]
    for b in bad:
        with pytest.raises(ProtocolError):
            StepColumns.from_wire(b, cols.others)
    with pytest.raises(ProtocolError):
        StepColumns.from_wire(wire, [])  # the other event is missing


@pytest.mark.parametrize("events", [
    # a lone evict, and a block evicted then stored again in one step (order matters)
    [{"kind": "evict", "tier": "gpu", "blocks": [0, 1]}],
    [{"kind": "evict", "tier": "gpu", "blocks": [0]},
     {"kind": "store", "tier": "gpu", "blocks": [0], "hashes": [9]}],
    [{"kind": "hit", "tier": "gpu", "seq": "b", "blocks": [0, 1]},
     {"kind": "free", "tier": "gpu", "seq": "b", "blocks": [0, 1]},
     {"kind": "evict", "tier": "gpu", "blocks": [1]}],
    # sequence-only events inside a hot run: a sequence finished and added again, its
    # blocks freed and taken by the new one (a new owner), preempted and resumed
    [{"kind": "seq_add", "seq": "x"}, {"kind": "seq_start", "seq": "x"},
     {"kind": "alloc", "tier": "gpu", "seq": "x", "blocks": [2, 3]},
     {"kind": "seq_preempt", "seq": "x", "mode": "recompute"},
     {"kind": "free", "tier": "gpu", "seq": "x", "blocks": [2, 3]},
     {"kind": "seq_finish", "seq": "x", "reason": "abort"},
     {"kind": "seq_add", "seq": "x"}, {"kind": "seq_resume", "seq": "x"},
     {"kind": "alloc", "tier": "cpu", "seq": "x", "blocks": [2, 3]}],
])
def test_order_within_a_step_on_the_array_path(monkeypatch, events):
    """Cases a refusal cannot hide: the array path must apply them itself, in order."""
    all_arrays(monkeypatch)
    setup = SETUP + [{"kind": "alloc", "tier": "gpu", "seq": "a", "blocks": [0, 1]},
                     {"kind": "store", "tier": "gpu", "blocks": [0, 1], "hashes": [1, 2]},
                     {"kind": "quantize", "tier": "gpu", "blocks": [1], "format": "fp8"},
                     {"kind": "free", "tier": "gpu", "seq": "a", "blocks": [0, 1]}]
    ref, fast = KVState(), KVState()
    apply_both(ref, fast, {"v": 2, "step": 0, "events": setup})
    apply_both(ref, fast, {"v": 2, "step": 1, "events": events})
    assert fast.columns_refused == 0


# ------------------------------------------------ clone(reuse=) of a long-lived mirror
def test_a_clone_reusing_the_last_frame_is_exact_when_the_touched_ids_were_given_up(
        monkeypatch):
    """A mirror nobody clones stops remembering every sequence id it ever touched (past
    ``_DIRTY_SLACK``): the next clone copies every sequence, still equal to the state."""
    monkeypatch.setattr(state_mod, "_DIRTY_SLACK", -(1 << 20))  # given up at once
    gen, sink, live = SyntheticCache(seed=3), ListSink(), KVState()
    frame = live.clone()
    for step in range(120):
        stats = gen.step(sink)
        live.apply({"v": 2, "step": step, "events": sink.drain(), "stats": stats})
        if step % 30 == 29:
            assert live._dirty_seqs is None
            frame = live.clone(reuse=frame)  # a full copy: exact, order included
            assert full_state(frame) == full_state(live)
    assert frame.canonical() == gen.canonical()
