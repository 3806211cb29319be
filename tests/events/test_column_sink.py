"""The engine side of the columnar path: a KVCacheManager recording into a ColumnSink
records exactly what the per-event reference (ListSink) collects, step by step, over
real cache-manager runs (prefix caching, forks, preemption by recompute and by swap,
the window group); its columns equal the columns built from the reference's events,
and the columnar mirror equals both the per-event mirror and the manager itself."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.bench.events import ManagerWorkload
from engine.cache import KVCacheManager
from engine.events import KVState
from engine.events.column_sink import ColumnSink
from engine.events.columns import DTYPES, StepColumns
from engine.events.sink import ListSink
from engine.events.wire import codec as C

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
        batch = C.make_batch("e", step + 1, step, 0.0, events, stats)
        per_event.apply(batch)
        columnar.apply({**batch, "events": cols.to_events(), "columns": cols})
        truth = managers[1].snapshot()
        assert per_event.canonical() == truth == columnar.canonical(), f"step {step}"
        kinds.update(e["kind"] for e in events)
    assert columnar.columns_refused == 0  # the array path took every step itself
    assert {"alloc", "free"} <= kinds
