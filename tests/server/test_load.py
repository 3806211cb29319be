"""`kvscope load` completes every named workload against the real daemon, and its
summary agrees with /metrics (scraped independently here) and with the server's own
counters: requests, prompt and generated tokens, prefix lookups and hits, preemptions."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvscope.engine.loadgen.workloads import list_workloads
from tests.server.conftest import REPO, Daemon
from tests.waiting import HANG_S


@pytest.mark.parametrize("workload", list_workloads())
def test_workload_summary_agrees_with_metrics(daemon: Daemon, workload: str) -> None:
    before = daemon.metrics()
    run = subprocess.run(
        [sys.executable, "-m", "kvscope.engine.cli", "load", "--url", daemon.url, "--workload",
         workload, "--num-requests", "2", "--max-tokens", "3", "--rate", "50",
         "--duration", "60", "--json", "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stdout + run.stderr
    s = json.loads(run.stdout)
    after = daemon.metrics()

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert s["workload"] == workload and s["requests"] == s["ok"] == 2 and s["failed"] == 0
    assert s["ttft_ms"]["p50"] > 0 and s["e2e_ms"]["p99"] >= s["ttft_ms"]["p99"]
    server = s["server"]
    # The summary's server figures are /metrics deltas...
    assert server["requests"] == delta("kvscope:request_success_total") == 2
    assert server["preemptions"] == delta("kvscope:num_preemptions_total")
    assert server["prefix_hits"] == delta("kvscope:prefix_cache_hits_total")
    # ...and the client's own counts (from each response's usage) agree with them.
    assert s["prompt_tokens"] == server["prompt_tokens"] == delta("kvscope:prompt_tokens_total")
    assert s["completion_tokens"] == server["generation_tokens"] == 2 * 3
    # latency creep: decoded tokens by context length, as the server's histogram counted
    creep = s["decode_by_context"]
    assert creep and all(r["tpot_ms"] > 0 for r in creep)
    assert sum(r["tokens"] for r in creep) == delta(
        "kvscope:time_per_output_token_by_context_seconds_count") > 0
    if server["preemptions"] == 0:  # one prefix lookup per request
        assert s["cached_tokens"] == server["prefix_hits"]
        assert s["prompt_tokens"] == server["prefix_queries"]
    else:  # a preempted request is looked up again when it resumes
        assert s["cached_tokens"] <= server["prefix_hits"]


def test_table_output_and_bad_arguments(daemon: Daemon) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvscope.engine.cli", "load", "--url", daemon.url, "--workload",
         "shared_system_chat", "--num-requests", "1", "--max-tokens", "2", "--no-progress"],
        cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert run.returncode == 0, run.stderr
    for row in ("TTFT p50 / p99", "TPOT p50 / p99", "throughput", "prefix hit rate",
                "preemptions", "swaps", "decode by context"):
        assert row in run.stdout
    bad = subprocess.run([sys.executable, "-m", "kvscope.engine.cli", "load", "--workload", "nope"],
                         cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert bad.returncode == 2 and "named ones" in bad.stderr
    down = subprocess.run([sys.executable, "-m", "kvscope.engine.cli", "load", "--url",
                           "http://127.0.0.1:9", "--num-requests", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert down.returncode == 1 and "cannot read" in down.stderr
