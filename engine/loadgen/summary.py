"""The load run's summary: client-side timings plus the server's own counters.

Server numbers are the difference of two /metrics scrapes (before and after the run), so
they are exactly what Prometheus would show for the run, provided nothing else used the
server meanwhile. The client's token counts come from each response's ``usage``; on a
quiet server they equal the server's counters (the tests check it).
"""

from __future__ import annotations

import math
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvscope.engine.loadgen.runner import RequestRecord

# /metrics samples the summary reads (sums over labels).
SERVER_COUNTERS = {
    "requests": "kvscope:request_success_total",
    "prompt_tokens": "kvscope:prompt_tokens_total",
    "generation_tokens": "kvscope:generation_tokens_total",
    "prefix_queries": "kvscope:prefix_cache_queries_total",
    "prefix_hits": "kvscope:prefix_cache_hits_total",
    "preemptions": "kvscope:num_preemptions_total",
    "evictions": "kvscope:kv_cache_evictions_total",
    "swap_out_blocks": "kvscope:swap_out_blocks_total",
    "swap_in_blocks": "kvscope:swap_in_blocks_total",
    "aborted": "kvscope:request_aborted_total",
    "prefill_tokens": "kvscope:prefill_computed_tokens_total",
    "recomputed_tokens": "kvscope:recomputed_prefill_tokens_total",
}


DECODE_BY_CONTEXT = "kvscope:time_per_output_token_by_context_seconds"


def parse_metrics(text: str) -> dict[str, float]:
    """{sample name: value summed over label sets} of a Prometheus text exposition, plus
    the per-context-length sum and count of the decode-time histogram under
    ``"<name>_sum|<context range>"`` and ``"<name>_count|<context range>"``."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
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
    server = {k: after.get(name, 0.0) - before.get(name, 0.0)
              for k, name in SERVER_COUNTERS.items()}
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
        "server": {**{k: int(v) for k, v in server.items()},
                   "prefix_hit_rate": (server["prefix_hits"] / server["prefix_queries"]
                                       if server["prefix_queries"] else 0.0)},
    }


def _scale(v: float | None, k: float) -> float | None:
    return None if v is None else v * k


def table(s: dict[str, Any]) -> str:
    """The human summary: one row per figure."""
    def f(v: float | None, unit: str = "") -> str:
        return "-" if v is None else f"{v:,.1f}{unit}"

    sv = s["server"]
    rows = [
        ("workload", s["workload"]),
        ("requests", f"{s['ok']} ok, {s['failed']} failed, {s['cancelled']} cancelled at the "
                     f"end (server counted {sv['requests']} finished, {sv['aborted']} aborted)"),
        ("elapsed", f(s["elapsed_s"], " s")),
        ("TTFT p50 / p99", f"{f(s['ttft_ms']['p50'])} / {f(s['ttft_ms']['p99'])} ms"),
        ("TPOT p50 / p99", f"{f(s['tpot_ms']['p50'])} / {f(s['tpot_ms']['p99'])} ms"),
        ("latency p50 / p99", f"{f(s['e2e_ms']['p50'])} / {f(s['e2e_ms']['p99'])} ms"),
        ("throughput", f"{s['throughput']['requests_per_s']:.2f} req/s, "
                       f"{s['throughput']['output_tokens_per_s']:.1f} output tok/s"),
        ("tokens", f"{s['prompt_tokens']} prompt ({s['cached_tokens']} cached), "
                   f"{s['completion_tokens']} generated"),
        ("prefix hit rate", f"{sv['prefix_hit_rate']:.1%} of looked-up tokens (server); "
                            f"{s['client_cached_fraction']:.1%} of prompt tokens cached"),
        ("preemptions", str(sv["preemptions"])),
        ("evictions", f"{sv['evictions']} blocks"),
        ("swaps", f"{sv['swap_out_blocks']} blocks out, {sv['swap_in_blocks']} in"),
        ("recompute", f"{sv.get('recomputed_tokens', 0)} of {sv.get('prefill_tokens', 0)} "
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
