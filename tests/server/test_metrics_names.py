"""``--metrics-prefix vllm``: every metric of the committed list (derived from a real
vLLM 0.32 /metrics scrape; tests/events/test_vllm_peer.py re-checks the list against a
live vLLM) is exported with vLLM's name, type and label names; kvscope's extras keep the
kvscope: prefix; the default prefix is unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.server.metrics import ServerMetrics
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
