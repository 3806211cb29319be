"""The engine side of the columnar path: a KVCacheManager recording into a ColumnSink
records exactly what the per-event reference (ListSink) collects, step by step, over
real cache-manager runs (prefix caching, forks, preemption by recompute and by swap,
the window group); its columns equal the columns built from the reference's events,
and the columnar mirror equals both the per-event mirror and the manager itself."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.engine.bench.event_workloads import ManagerWorkload
from kvscope.engine.cache import KVCacheManager
from kvscope.engine.events import KVState
from kvscope.engine.events.column_sink import ColumnSink
from kvscope.engine.events.columns import DTYPES, StepColumns
from kvscope.engine.events.sink import ListSink
from kvscope.engine.events.wire import EventStream, Recording
from kvscope.engine.events.wire import codec as C
from tests.waiting import HANG_S

CONFIGS = {  # KVCacheManager keyword arguments
    "plain": {},
    "host tier": {"num_cpu_blocks": 48},
    "window group": {"window": 32, "num_window_blocks": 64, "enable_prefix_caching": False},
    "no prefix cache": {"enable_prefix_caching": False},
}


def _same_columns(got: StepColumns, want: StepColumns) -> None:
    for name in DTYPES:
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
    assert (got.names, got.causes, got.others) == (want.names, want.causes, want.others)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(seed=st.integers(0, 1 << 16), config=st.sampled_from(sorted(CONFIGS)),
       num_blocks=st.sampled_from([24, 64, 160]), max_running=st.sampled_from([4, 16, 48]))
def test_column_sink_records_what_the_reference_collects(seed, config, num_blocks,
                                                         max_running):
    ref, col = ListSink(), ColumnSink()
    managers = [KVCacheManager(num_blocks, 16, sink=s, **CONFIGS[config]) for s in (ref, col)]
    works = [ManagerWorkload(m, seed=seed, max_running=max_running) for m in managers]
    per_event, columnar = KVState(), KVState()
    kinds: set[str] = set()
    for step in range(30):
        stats = [w.step() for w in works][1] if step else {}
        events, recorded = ref.drain(), col.drain()
        assert recorded.events() == events, f"step {step}"
        cols = recorded.columns()
        _same_columns(cols, StepColumns.from_events(events))
        assert recorded.columns(with_events=False).to_events() == events
        batch = C.make_batch("e", step + 1, step, 0.0, events, stats)
        per_event.apply(batch)
        columnar.apply({**batch, "events": cols.to_events(), "columns": cols})
        truth = managers[1].snapshot()
        assert per_event.canonical() == truth == columnar.canonical(), f"step {step}"
        kinds.update(e["kind"] for e in events)
    assert columnar.columns_refused == 0  # the array path took every step itself
    assert {"alloc", "free"} <= kinds


def _long_prompts(manager: KVCacheManager, step: int, live: list[str]) -> None:
    """One step of long prompts: bulk steps (hundreds of block ids, 64 an event)."""
    for j in range(5):
        sid = f"s{step}.{j}"
        manager.add_sequence(sid, [(step * 7 + j + t) % 997 for t in range(64 * 16)])
        manager.match_prefix(sid)
        if manager.allocate_slots(sid, len(manager.token_ids(sid))) is None:
            manager.free(sid)
            continue
        manager.start(sid)
        live.append(sid)
    while len(live) > 8:  # the older ones finish
        manager.finish(live.pop(0), "stop")
    manager.flush_step_events()


@pytest.mark.parametrize("consumer", [False, True])
def test_bulk_steps_from_the_engine_columns_reach_the_recording(tmp_path, consumer):
    path = tmp_path / "bulk.kvtrace"
    seen: list[dict] = []
    with EventStream(record_path=str(path)) as stream:
        if consumer:  # a consumer reads every event of the step as maps
            stream.add_consumer(lambda b: seen.extend(b["events"]))
        manager = KVCacheManager(2048, 16, sink=stream.sink)
        stream.end_step(0, {})
        live: list[str] = []
        for step in range(1, 9):
            _long_prompts(manager, step, live)
            stream.end_step(step, {})
        assert stream.wait_idle(HANG_S)
        truth, counts = manager.snapshot(), stream.kind_counts
    with Recording(path) as rec:
        assert rec.state_at(8).canonical() == truth
        assert any("columns" in b for b in rec.batches())  # bulk steps went as columns
    assert counts["alloc"] >= 20 and counts["free"] >= 10
    if consumer:
        assert len(seen) == sum(counts.values())


def test_every_typed_call_records_what_the_reference_collects():
    """Each typed sink call, also the forms the manager runs above may not reach (an
    evict without a cause, a hash beyond int64, a step of only lifecycle rows), means
    the ``emit`` it names: ColumnSink's events and columns equal ListSink's, and the
    stream's side table reads the typed lifecycle rows as it reads their maps."""
    def calls(sink):
        sink.seq_add("a", 40, 2)
        sink.seq_start("a")
        sink.block_op("alloc", "gpu", "a", [3, 4, 5])
        sink.block_op("hit", "gpu", "a", [1], 16)
        sink.store("gpu", [3, 4], [11, -12])
        sink.store("gpu", [5], [1 << 70])  # beyond int64: stays a map in the columns
        sink.evict("gpu", [1, 2], {"policy": "lru", "reason": "alloc"})
        sink.evict("cpu", [7], None)
        sink.seq_tokens(["a"], [41])
        sink.emit("cow", tier="gpu", seq="a", logical=[0], src=[3], dst=[9])
        sink.block_op("free", "gpu", "a", [3, 4, 5, 9])
        sink.seq_finish("a", "stop", 41, 1)

    ref, col = ListSink(), ColumnSink()
    calls(ref)
    calls(col)
    events, recorded = ref.drain(), col.drain()
    assert recorded.events() == events
    assert [list(e) for e in recorded.events()] == [list(e) for e in events]  # key order
    _same_columns(recorded.columns(), StepColumns.from_events(events))
    assert recorded.columns(with_events=False).to_events() == events

    # the wire's form (id lists packed): built straight from the rows, the same bytes
    fresh = ColumnSink()
    calls(fresh)
    assert C.pack_events(fresh.drain().events(packed=True)) == C.pack_events(
        [dict(e) for e in events])

    # the stream's side table (prompt sizes, priorities, hit tokens for snapshots) reads
    # the typed rows as it reads their maps; "b" stays, so its extras remain
    ref.seq_add("b", 8, 1)
    ref.block_op("hit", "gpu", "b", [1], 16)
    col.seq_add("b", 8, 1)
    col.block_op("hit", "gpu", "b", [1], 16)
    tables = []
    for note in ("rows", "maps"):
        stream = EventStream()  # off: no thread; its side-table methods still run
        for step in (recorded, col.drain()) if note == "rows" else (events, ref.drain()):
            if note == "rows":
                stream._note_recorded(step)
            else:
                stream._note_extras(step)
        tables.append((stream._kind_counts, stream._extras))
    assert tables[0] == tables[1]
    assert tables[0][1] == {"b": [8, 1, None, 0, 16]}
