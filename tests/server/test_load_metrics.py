"""`kvscope load`'s server figures come from the server's /metrics under either naming:
kvscope's, vLLM's own (a vLLM 0.32/0.33 server; the exposition here is made the way
vLLM's PrometheusStatLogger makes it, and its names and labels are checked against a
real vLLM 0.32 scrape), and kvscope's under ``--metrics-prefix vllm``. In each case the
server's counts are built to differ from what the client saw, so a summary that took
the client's own counts (or read 0 for names it does not know) fails."""

from __future__ import annotations

import json

import prometheus_client as prom
import pytest

from kvscope.engine.loadgen.runner import RequestRecord
from kvscope.engine.loadgen.summary import in_flight, parse_metrics, summarize, table
from kvscope.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvscope.engine.server.metrics import ServerMetrics
from tests.server.conftest import REPO

VLLM_FINISH_REASONS = ("stop", "length", "abort", "error")  # vLLM's FinishReason values


def _vllm_text(queries: int, hits: int, preemptions: int, finished: dict[str, int],
               running: int = 0, waiting: int = 0) -> str:
    """/metrics of a vLLM engine core (engine "0"), as vLLM's PrometheusStatLogger builds
    it: prometheus_client metrics named and labelled as in vllm/v1/metrics/loggers.py."""
    r = prom.CollectorRegistry()
    labels = ["model_name", "engine"]
    lv = ("Qwen/Qwen3-0.6B", "0")
    for name, value in (("vllm:num_requests_running", running),
                        ("vllm:num_requests_waiting", waiting)):
        prom.Gauge(name, "gauge", labels, registry=r).labels(*lv).set(value)
    for name, value in (("vllm:prefix_cache_queries", queries),
                        ("vllm:prefix_cache_hits", hits),
                        ("vllm:num_preemptions", preemptions),
                        ("vllm:prompt_tokens", 4000), ("vllm:generation_tokens", 300)):
        prom.Counter(name, "counter", labels, registry=r).labels(*lv).inc(value)
    success = prom.Counter("vllm:request_success", "Count of successfully processed requests.",
                           [*labels, "finished_reason"], registry=r)
    for reason in VLLM_FINISH_REASONS:  # every reason is a series from the start
        success.labels(*lv, reason).inc(finished.get(reason, 0))
    return prom.generate_latest(r).decode()


def _client(n: int) -> list[RequestRecord]:
    """n requests as the client saw them (no cached tokens reported in usage)."""
    return [RequestRecord(session=i, turn=0, tag="t", start_s=0.0, ok=True, ttft_s=0.2,
                          latency_s=1.0, prompt_tokens=100, completion_tokens=10)
            for i in range(n)]


def test_the_canned_vllm_exposition_uses_a_real_vllm_scrapes_names():
    real = json.loads((REPO / "tests/fixtures/vllm-0.32.0-metrics.json").read_text())["metrics"]
    text = _vllm_text(1, 1, 1, {"stop": 1}, running=1, waiting=1)
    from prometheus_client.parser import text_string_to_metric_families

    seen = 0
    for family in text_string_to_metric_families(text):
        if family.name.endswith("_created"):  # prometheus_client's creation times
            continue
        assert family.name in real, family.name
        assert family.type == real[family.name]["type"]
        for s in family.samples:
            assert sorted(s.labels) == sorted(real[family.name]["labels"]), s
        seen += 1
    assert seen == 8


def test_summary_reads_vllms_own_metrics():
    before = parse_metrics(_vllm_text(queries=1000, hits=100, preemptions=1,
                                      finished={"stop": 2, "abort": 1}, running=0))
    after = parse_metrics(_vllm_text(queries=1000 + 2048, hits=100 + 1536, preemptions=1 + 3,
                                     finished={"stop": 2 + 5, "length": 2, "abort": 1 + 4,
                                               "error": 1}, running=2, waiting=1))
    s = summarize(_client(6), 10.0, before, after, "shared_system_chat")
    sv = s["server"]
    assert s["server_metrics"] == "vllm"
    # the server's counts, not the client's (6 ok, no cached tokens)
    assert sv["requests"] == 7 and s["ok"] == 6
    assert sv["aborted"] == 4
    assert sv["prefix_queries"] == 2048 and sv["prefix_hits"] == 1536
    assert sv["prefix_hit_rate"] == 0.75 and s["client_cached_fraction"] == 0.0
    assert sv["preemptions"] == 3
    assert sv["evictions"] is None and sv["swap_out_blocks"] is None  # vLLM has none
    out = table(s)
    assert "75.0% of looked-up tokens (server)" in out
    assert "server counted 7 finished, 4 aborted (vLLM's metrics)" in out
    assert "not reported" in out
    assert in_flight(after) == 3 and in_flight(before) == 0


def _kvscope_text(prefix: str, finished: int, aborted: int, hits: int, queries: int,
                  preemptions: int, evictions: int = 0) -> str:
    """/metrics of kvscope's own ServerMetrics (the daemon's), fed by hand."""
    m = ServerMetrics("smollm2", prefix=prefix)
    m._engine.snapshot = {"query_tokens": queries, "hit_tokens": hits,
                          "preemptions": preemptions, "evictions": evictions,
                          "running": 1}
    for i in range(finished):
        out = RequestOutput(f"r{i}", None, [1, 2], [CompletionOutput(
            index=0, text="x", token_ids=[3], cumulative_logprob=None, logprobs=None,
            finish_reason="stop")], finished=True,
            metrics=RequestMetrics(arrival_time=0.0, first_token_time=0.1,
                                   finished_time=0.2, num_prompt_tokens=2,
                                   num_generation_tokens=1))
        m.on_finish(out)
    for _ in range(aborted):
        m.on_abort("client")
    return m.render().decode()


@pytest.mark.parametrize("prefix", ["kvscope", "vllm"])
def test_summary_reads_kvscope_metrics_under_either_prefix(prefix):
    before = parse_metrics(_kvscope_text(prefix, 0, 0, 0, 0, 0, evictions=5))
    after = parse_metrics(_kvscope_text(prefix, finished=5, aborted=2, hits=64, queries=256,
                                        preemptions=2, evictions=5 + 9))
    s = summarize(_client(3), 5.0, before, after, "w")
    sv = s["server"]
    assert s["server_metrics"] == prefix
    assert sv["requests"] == 5 and sv["aborted"] == 2 and sv["preemptions"] == 2
    assert sv["prefix_hit_rate"] == 0.25
    assert sv["evictions"] == 9  # kvscope's own counters keep the kvscope: prefix
    assert in_flight(after) == 1


def test_a_server_without_known_counters_is_said_so():
    s = summarize(_client(2), 1.0, {}, {"other_metric": 1.0}, "w")
    assert s["server"]["requests"] is None and s["server"]["prefix_hit_rate"] is None
    assert s["server_metrics"] is None
    assert "neither kvscope's nor vLLM's request counters" in table(s)
