"""The vLLM translator reads a batch in columns (``engine.events.columns``): its output
and its state after every batch equal ``translate`` of the same batch's events, over
real cache-manager streams (stores with and without vLLM detail, evictions, offloads,
host hits, a seq gap) and long-context bulk steps."""

from __future__ import annotations

from typing import Any

from kvscope.engine.bench.event_workloads import ManagerWorkload, bulk_batches
from kvscope.engine.cache import KVCacheManager
from kvscope.engine.events.columns import StepColumns
from kvscope.engine.events.sink import ListSink
from kvscope.engine.events.vllm import kv_events_wire as W
from kvscope.engine.events.vllm.translate import VllmTranslator
from kvscope.engine.events.wire.codec import make_batch


def _state(tr: VllmTranslator) -> tuple[Any, ...]:
    return (tr.blocks, tr.holders, tr.announced, tr.block_size, tr.described,
            tr.last_seq, tr.undescribed, tr.resets)


def _same_on_both_paths(batches: list[dict[str, Any]]) -> dict[str, int]:
    """Translate every batch per event and from its columns; assert equal output and
    state after each batch. Returns counts of what was exercised."""
    per_event, columnar = VllmTranslator(), VllmTranslator()
    seen = {"rows": 0, "others": 0, "stored": 0, "removed": 0, "cleared": 0}
    for batch in batches:
        cols = StepColumns.from_events(batch["events"])
        cols.source = None  # the columns alone, as a decoded protocol-3 batch holds them
        want = per_event.translate(batch)
        got = columnar.translate({**batch, "events": cols.others, "columns": cols})
        assert got == want, batch["seq"]
        assert _state(columnar) == _state(per_event), batch["seq"]
        seen["rows"] += len(cols) - len(cols.others)
        seen["others"] += len(cols.others)
        for ev in want:
            key = {W.BLOCK_STORED: "stored", W.BLOCK_REMOVED: "removed"}.get(ev["type"],
                                                                            "cleared")
            seen[key] += 1
    return seen


def _manager_batches(store_detail: bool, gap_at: int, steps: int = 200) -> list[dict]:
    sink = ListSink()
    sink.store_detail = store_detail
    work = ManagerWorkload(KVCacheManager(48, 16, num_cpu_blocks=32, sink=sink), seed=5,
                           max_running=12)
    out = []
    for step in range(steps):
        stats = work.step() if step else {}
        seq = step if step < gap_at else step + 3  # the stream dropped three batches
        out.append(make_batch("e", seq, seq, float(seq), sink.drain(), stats))
    return out


def test_columns_equal_events_on_a_real_cache_manager_with_a_gap():
    seen = _same_on_both_paths(_manager_batches(store_detail=True, gap_at=120))
    # evictions travel as rows, detailed stores and offloads/host hits as maps
    assert seen["rows"] and seen["others"] and seen["stored"] and seen["removed"]
    assert seen["cleared"] == 1


def test_columns_equal_events_with_stores_as_rows():
    """Without vLLM detail every store fits the columns: the hashes come from ``vals``
    (announced only when described before, as the per-event path says)."""
    plain = _manager_batches(store_detail=False, gap_at=10**9)
    detailed = _manager_batches(store_detail=True, gap_at=10**9)  # the same run (seed)
    # detailed stores describe hashes first, then detail-less ones re-index them
    seen = _same_on_both_paths(detailed[:60] + plain[60:])
    assert seen["rows"] and seen["stored"] and seen["removed"]


def test_columns_equal_events_on_bulk_steps():
    batches = [make_batch("e", i, i, float(i), events, stats)
               for i, (events, stats) in enumerate(bulk_batches(12, blocks_per_seq=256,
                                                                live=4, num_blocks=4096))]
    seen = _same_on_both_paths(batches)
    assert seen["rows"] > 12


def test_publisher_translates_column_batches_after_the_stream_packs_them(tmp_path):
    """``VllmPublisher.on_batch`` of a column batch keeps its own copy of the maps: the
    stream packs them in place right after (as ``EventStream`` does), and the
    publisher's translator still ends where a per-event one does."""
    from kvscope.engine.events.vllm.config import KVEventsConfig
    from kvscope.engine.events.vllm.kv_events_publisher import VllmPublisher
    from kvscope.engine.events.wire.codec import pack_events
    from tests.waiting import HANG_S

    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/pub",
                         replay_endpoint=f"ipc://{tmp_path}/replay", topic="kv")
    pub, ref = VllmPublisher(cfg), VllmTranslator()
    try:
        for batch in _manager_batches(store_detail=True, gap_at=10**9, steps=80):
            ref.translate(batch)
            cols = StepColumns.from_events(batch["events"])
            pub.on_batch({**batch, "events": cols.source, "columns": cols})
            pack_events(cols.source)  # the stream's protocol-2 packing, in place
        assert pub.wait_idle(HANG_S) and pub.errors == 0
        assert _state(pub.translator) == _state(ref)
        assert pub.seq > 0
    finally:
        pub.close()
