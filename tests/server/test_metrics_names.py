"""``--metrics-prefix vllm``: every metric of the committed list (derived from a real
vLLM 0.32 /metrics scrape; tests/events/test_vllm_peer.py re-checks the list against a
live vLLM) is exported with vLLM's name, type and label names; kvscope's extras keep the
kvscope: prefix; the default prefix is unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvscope.engine.server.metrics import ServerMetrics
from tests.server.doubles import ScriptedLLMEngine

LIST = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32.0-metrics.json"


def _busy_engine() -> ScriptedLLMEngine:
    """An engine in the middle of its work, as /metrics reads it after a step."""
    engine = ScriptedLLMEngine()
    engine.add_request("r", {"prompt_token_ids": [1, 2]}, None)
    engine.stats = {"running": 2, "waiting": 1, "decode_tokens": 2, "preemptions": 1}
    engine.cache.figures = {"tiers": {"gpu": {"total": 100, "used": 25}},
                            "prefix_query_tokens": 40, "prefix_hit_tokens": 16,
                            "evictions": 3, "used_tokens": 350}
    return engine


def _families(m: ServerMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def test_vllm_prefix_matches_vllms_names_types_labels():
    m = ServerMetrics("smollm2", prefix="vllm")
    engine = _busy_engine()
    m.on_step(engine)
    m.on_step(engine)  # the second step observes inter-token latencies
    fams = _families(m)
    for name, spec in json.loads(LIST.read_text())["metrics"].items():
        assert name in fams, name
        f = fams[name]
        assert f.type == spec["type"], name
        labels = set().union(*(s.labels for s in f.samples)) - {"le"}
        assert labels == set(spec["labels"]), (name, labels)
        assert all(s.labels.get("model_name") == "smollm2" for s in f.samples)
    values = {s.name: s.value for f in fams.values() for s in f.samples}
    assert values['vllm:kv_cache_usage_perc'] == 0.25
    assert values["vllm:prefix_cache_hits_total"] == 16
    assert values["vllm:inter_token_latency_seconds_count"] == 2
    assert "kvscope:kv_cache_evictions" in fams and "vllm:kv_cache_evictions" not in fams


def test_default_prefix_is_unchanged_and_bad_prefix_refused():
    fams = _families(ServerMetrics("smollm2"))
    assert "kvscope:kv_cache_usage_perc" in fams
    assert "kvscope:time_per_output_token_seconds" in fams
    assert not any(n.startswith("vllm:") for n in fams)
    with pytest.raises(ValueError, match="metrics prefix"):
        ServerMetrics("smollm2", prefix="sglang")


def test_per_tier_series_take_vllms_tiering_names_and_a_tier_label():
    engine = _busy_engine()
    # 64 prefix-hit tokens, 32 of them from the host: 4 blocks, 2 on the gpu
    engine.cache.figures.update(prefix_hit_tokens=64, host_hit_tokens=32, offloaded_blocks=5)
    engine.swapper = SimpleNamespace(stats=lambda: {"swap_in_bytes": 2048,
                                                    "swap_out_bytes": 4096})
    engine.disk_io = SimpleNamespace(stats=SimpleNamespace(
        bytes_read=300, read_s=0.5, bytes_written=700, write_s=0.25, read_timeouts=3),
        store=SimpleNamespace(disabled=True))
    engine.cache.disk = SimpleNamespace(arrived_blocks=3, stored_blocks=9, write_failures=1,
                                        read_misses=2, prefetched_blocks=4,
                                        prefetch_timeouts=1, enabled=False)
    for prefix in ("vllm", "kvscope"):
        m = ServerMetrics("smollm2", prefix=prefix)
        m.on_step(engine)
        got = {(s.name, s.labels["tier"]): s.value for f in _families(m).values()
               for s in f.samples if "tier" in s.labels}
        hits = f"{prefix}:kv_offload_tiering_block_hits_total"
        assert got[(hits, "gpu")] == 2
        assert got[(hits, "cpu")] == 2 and got[(hits, "disk")] == 3
        assert got[(f"{prefix}:kv_offload_tiering_read_bytes_total", "cpu")] == 2048
        assert got[(f"{prefix}:kv_offload_tiering_write_bytes_total", "disk")] == 700
        assert got[(f"{prefix}:kv_offload_tiering_read_time_total", "disk")] == 0.5
        assert got[("kvscope:kv_tier_dropped_blocks_total", "disk")] == 1
        assert got[("kvscope:kv_tier_load_misses_total", "disk")] == 2
        assert got[("kvscope:kv_prefetch_timeouts_total", "disk")] == 1
        # a disk tier turned off after reads kept timing out says so (issue 49, defect 5)
        assert got[("kvscope:kv_tier_read_timeouts_total", "disk")] == 3
        assert got[("kvscope:kv_tier_disabled", "disk")] == 1
        assert ("kvscope:kv_tier_stored_blocks_total", "cpu") in got


def test_without_host_or_disk_only_the_gpu_tier_is_exported():
    m = ServerMetrics("smollm2")
    m.on_step(_busy_engine())
    tiers = {s.labels["tier"] for f in _families(m).values() for s in f.samples
             if "tier" in s.labels}
    assert tiers == {"gpu"}
