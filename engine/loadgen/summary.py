"""The load run's summary: client-side timings plus the server's own counters.

Server numbers are the difference of two /metrics scrapes (before and after the run), so
they are exactly what Prometheus would show for the run, provided nothing else used the
server meanwhile. The client's token counts come from each response's ``usage``; on a
quiet server they equal the server's counters (the tests check it).

The server may be kvscope (``kvscope:`` names, or vLLM's names under ``kvscope serve
--metrics-prefix vllm``) or vLLM itself (0.32 and 0.33 export the same names): each
figure is read from the first of its names the server exports, and is None (shown as
"not reported") when it exports none of them, never a made-up 0. Finished requests are
``request_success`` without its ``abort`` and ``error`` series: kvscope counts those in
``request_aborted`` instead, vLLM labels them ``finished_reason``.
"""

from __future__ import annotations

import math
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvscope.engine.loadgen.runner import RequestRecord

# /metrics samples the summary reads (sums over labels), each figure from the first of
# its names the server exports: kvscope's, then vLLM's (vLLM has no eviction, swap or
# recompute counters). "NAME|finished_reason=R" is NAME's series with that label.
SUCCESS = ("kvscope:request_success_total", "vllm:request_success_total")
NOT_FINISHED = ("abort", "error")  # finish reasons that are no success of the run
SERVER_COUNTERS: dict[str, tuple[str, ...]] = {
    "requests": SUCCESS,  # less their NOT_FINISHED series (finished_requests)
    "prompt_tokens": ("kvscope:prompt_tokens_total", "vllm:prompt_tokens_total"),
    "generation_tokens": ("kvscope:generation_tokens_total", "vllm:generation_tokens_total"),
    "prefix_queries": ("kvscope:prefix_cache_queries_total",
                       "vllm:prefix_cache_queries_total"),
    "prefix_hits": ("kvscope:prefix_cache_hits_total", "vllm:prefix_cache_hits_total"),
    "preemptions": ("kvscope:num_preemptions_total", "vllm:num_preemptions_total"),
    "evictions": ("kvscope:kv_cache_evictions_total",),
    "swap_out_blocks": ("kvscope:swap_out_blocks_total",),
    "swap_in_blocks": ("kvscope:swap_in_blocks_total",),
    "aborted": ("kvscope:request_aborted_total",
                "vllm:request_success_total|finished_reason=abort"),
    "prefill_tokens": ("kvscope:prefill_computed_tokens_total",),
    "recomputed_tokens": ("kvscope:recomputed_prefill_tokens_total",),
}
IN_FLIGHT = ("kvscope:num_requests_running", "kvscope:num_requests_waiting",
             "vllm:num_requests_running", "vllm:num_requests_waiting")


DECODE_BY_CONTEXT = "kvscope:time_per_output_token_by_context_seconds"


def parse_metrics(text: str) -> dict[str, float]:
    """{sample name: value summed over label sets} of a Prometheus text exposition, plus
    the per-context-length sum and count of the decode-time histogram under
    ``"<name>_sum|<context range>"`` and ``"<name>_count|<context range>"``, and each
    ``finished_reason`` series under ``"<name>|finished_reason=<reason>"``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
            reason = s.labels.get("finished_reason")
            if reason is not None:
                key = f"{s.name}|finished_reason={reason}"
                out[key] = out.get(key, 0.0) + s.value
            ctx = s.labels.get("context_tokens")
            if ctx is not None and s.name in (DECODE_BY_CONTEXT + "_sum",
                                              DECODE_BY_CONTEXT + "_count"):
                key = f"{s.name}|{ctx}"
                out[key] = out.get(key, 0.0) + s.value
    return out


def decode_by_context(before: dict[str, float], after: dict[str, float]
                      ) -> list[dict[str, Any]]:
    """[{context_tokens, tokens, tpot_ms}] over the run (two scrapes), by context range in
    increasing order: the server's mean step time per decoded token at each context
    length (latency creep)."""
    head = DECODE_BY_CONTEXT + "_count|"
    ranges = sorted((k[len(head):] for k in after if k.startswith(head)),
                    key=lambda r: int(r.split("-")[0].rstrip("+")))
    rows = []
    for ctx in ranges:
        n = after.get(f"{DECODE_BY_CONTEXT}_count|{ctx}", 0.0) - before.get(
            f"{DECODE_BY_CONTEXT}_count|{ctx}", 0.0)
        total = after.get(f"{DECODE_BY_CONTEXT}_sum|{ctx}", 0.0) - before.get(
            f"{DECODE_BY_CONTEXT}_sum|{ctx}", 0.0)
        if n > 0:
            rows.append({"context_tokens": ctx, "tokens": int(n), "tpot_ms": total / n * 1e3})
    return rows


def finished_requests(m: dict[str, float], name: str) -> float:
    """Requests the ``request_success`` counter ``name`` counted as finished: its total
    less its NOT_FINISHED series (vLLM's; kvscope counts those elsewhere, so they are 0)."""
    return m.get(name, 0.0) - sum(m.get(f"{name}|finished_reason={r}", 0.0)
                                  for r in NOT_FINISHED)


def server_figures(before: dict[str, float], after: dict[str, float]
                   ) -> tuple[dict[str, int | None], str | None]:
    """({figure: the run's delta, None when the server exports none of its names},
    the naming the finished-request count came from: "kvscope", "vllm" or None)."""
    out: dict[str, int | None] = {}
    source = None
    for key, names in SERVER_COUNTERS.items():
        name = next((n for n in names if n in after), None)
        if name is None:
            out[key] = None
        elif key == "requests":
            out[key] = int(finished_requests(after, name) - finished_requests(before, name))
            source = name.split(":", 1)[0]
        else:
            out[key] = int(after[name] - before.get(name, 0.0))
    return out, source


def in_flight(m: dict[str, float]) -> float:
    """Requests running or waiting on the server (kvscope's or vLLM's gauges)."""
    return sum(m.get(n, 0.0) for n in IN_FLIGHT)


def scrape(base_url: str, api_key: str | None = None) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(base_url.rstrip("/") + "/metrics", headers=headers, timeout=30)
    r.raise_for_status()
    return parse_metrics(r.text)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    v = sorted(values)
    return v[max(0, math.ceil(q / 100 * len(v)) - 1)]


def summarize(records: list[RequestRecord], elapsed_s: float, before: dict[str, float],
              after: dict[str, float], workload: str) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    cancelled = sum(r.cancelled for r in records)
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [t for r in ok if (t := r.tpot_s) is not None]
    e2e = [r.latency_s for r in ok if r.latency_s is not None]
    server, source = server_figures(before, after)
    prompt = sum(r.prompt_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ms = 1000.0
    return {
        "workload": workload,
        "elapsed_s": elapsed_s,
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok) - cancelled,
        "cancelled": cancelled,
        "errors": sorted({r.error for r in records if not r.ok and not r.cancelled})[:5],
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "ttft_ms": {"p50": _scale(percentile(ttft, 50), ms),
                    "p99": _scale(percentile(ttft, 99), ms)},
        "tpot_ms": {"p50": _scale(percentile(tpot, 50), ms),
                    "p99": _scale(percentile(tpot, 99), ms)},
        "e2e_ms": {"p50": _scale(percentile(e2e, 50), ms),
                   "p99": _scale(percentile(e2e, 99), ms)},
        "throughput": {"requests_per_s": len(ok) / elapsed_s if elapsed_s else 0.0,
                       "output_tokens_per_s": completion / elapsed_s if elapsed_s else 0.0},
        "client_cached_fraction": cached / prompt if prompt else 0.0,
        "decode_by_context": decode_by_context(before, after),
        "server_metrics": source,  # whose names the server's figures were read under
        "server": {**server, "prefix_hit_rate": _rate(server["prefix_hits"],
                                                       server["prefix_queries"])},
    }


def _rate(hits: int | None, queries: int | None) -> float | None:
    """Hits per looked-up token; None when the server does not count them."""
    if hits is None or queries is None:
        return None
    return hits / queries if queries else 0.0


def _scale(v: float | None, k: float) -> float | None:
    return None if v is None else v * k


def table(s: dict[str, Any]) -> str:
    """The human summary: one row per figure."""
    def f(v: float | None, unit: str = "") -> str:
        return "-" if v is None else f"{v:,.1f}{unit}"

    def n(v: int | None, unit: str = "") -> str:
        return "not reported" if v is None else f"{v}{unit}"

    sv = s["server"]
    by = {"vllm": " (vLLM's metrics)", "kvscope": ""}.get(s.get("server_metrics") or "", "")
    counted = f"server counted {n(sv['requests'])} finished, {n(sv['aborted'])} aborted{by}" \
        if sv["requests"] is not None else "the server's /metrics has neither kvscope's nor " \
        "vLLM's request counters"
    hit = "-" if sv["prefix_hit_rate"] is None else f"{sv['prefix_hit_rate']:.1%}"
    rows = [
        ("workload", s["workload"]),
        ("requests", f"{s['ok']} ok, {s['failed']} failed, {s['cancelled']} cancelled at the "
                     f"end ({counted})"),
        ("elapsed", f(s["elapsed_s"], " s")),
        ("TTFT p50 / p99", f"{f(s['ttft_ms']['p50'])} / {f(s['ttft_ms']['p99'])} ms"),
        ("TPOT p50 / p99", f"{f(s['tpot_ms']['p50'])} / {f(s['tpot_ms']['p99'])} ms"),
        ("latency p50 / p99", f"{f(s['e2e_ms']['p50'])} / {f(s['e2e_ms']['p99'])} ms"),
        ("throughput", f"{s['throughput']['requests_per_s']:.2f} req/s, "
                       f"{s['throughput']['output_tokens_per_s']:.1f} output tok/s"),
        ("tokens", f"{s['prompt_tokens']} prompt ({s['cached_tokens']} cached), "
                   f"{s['completion_tokens']} generated"),
        ("prefix hit rate", f"{hit} of looked-up tokens (server); "
                            f"{s['client_cached_fraction']:.1%} of prompt tokens cached"),
        ("preemptions", n(sv["preemptions"])),
        ("evictions", n(sv["evictions"], " blocks")),
        ("swaps", f"{n(sv['swap_out_blocks'], ' blocks')} out, {n(sv['swap_in_blocks'])} in"),
        ("recompute", f"{n(sv.get('recomputed_tokens'))} of {n(sv.get('prefill_tokens'))} "
                      "prefill tokens computed again after preemption"),
    ]
    creep = s.get("decode_by_context") or []
    if creep:
        rows.append(("decode by context", " · ".join(
            f"{r['context_tokens']}: {r['tpot_ms']:,.1f} ms ({r['tokens']} tok)"
            for r in creep)))
    if s["errors"]:
        rows.append(("errors", "; ".join(s["errors"])))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
