"""Prometheus metrics of the daemon, named as vLLM's, under the ``kvscope:`` prefix or,
with ``kvscope serve --metrics-prefix vllm``, exactly as vLLM 0.32 exposes them.

``--metrics-prefix vllm`` (for dashboards built for vLLM): the metrics vLLM also has take
its names, types and labels (``model_name`` = the served model name, ``engine`` = "0"):
``vllm:num_requests_running`` / ``_waiting``, ``vllm:kv_cache_usage_perc`` (gauges),
``vllm:prefix_cache_queries`` / ``_hits``, ``vllm:num_preemptions``,
``vllm:prompt_tokens``, ``vllm:generation_tokens``, ``vllm:request_success``
(``finished_reason``) (counters), ``vllm:time_to_first_token_seconds``,
``vllm:inter_token_latency_seconds``, ``vllm:request_time_per_output_token_seconds``,
``vllm:e2e_request_latency_seconds`` (histograms), and vLLM's tiered-offload counters
``vllm:kv_offload_tiering_block_hits`` / ``_read_bytes`` / ``_read_time`` /
``_write_bytes`` / ``_write_time`` with label ``tier`` (gpu, cpu, disk: ``TIER_COUNTERS``,
``tier_figures``). Metrics vLLM does not have (swap tier,
evictions, block count, aborts by reason) keep the ``kvscope:`` prefix either way, so a
name never claims vLLM's meaning for something vLLM does not measure. The default
(``kvscope``) keeps the names and label-free series this server has always exported
(the TPOT histogram there is ``kvscope:time_per_output_token_seconds``).

Inter-token latency: each token decoded in an engine step is observed once, as the wall
time since the previous engine step ended (tokens of consecutive steps are consecutive
tokens of their request under continuous batching; a preempted request's resumed token
is the exception).

Two kinds of source:
- per request (histograms and token counters), observed on the engine thread when a
  request finishes (prometheus-client's metrics are thread-safe);
- the engine's own cumulative counters and gauges (prefix queries/hits, preemptions,
  evictions, swaps, cache usage, running/waiting), read from a snapshot the engine thread
  refreshes after every step; a custom collector exposes the snapshot at scrape time, so
  a counter is exactly the engine's count, never a re-derived one.

Units as vLLM: ``kv_cache_usage_perc`` is a fraction in [0, 1]; prefix cache queries and
hits count tokens.

Latency creep: ``kvscope:time_per_output_token_by_context_seconds`` (histogram, always
``kvscope:``; vLLM has no such series) observes, for every token decoded in an engine
step, that step's duration, labelled ``context_tokens`` with the range of the decoding
sequence's context length (``CONTEXT_RANGES``: "0-127", "128-255", ... "32768+"). Its
``_sum / _count`` per label is the mean decode time per token at that context length; the
same figure the inspector's lifecycle index computes from the events.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvscope.engine.events.schema import FINISH_REASONS
from kvscope.engine.events.stats import StepStats
from kvscope.engine.outputs import RequestOutput

P = "kvscope:"
METRICS_PREFIXES = ("kvscope", "vllm")
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# Metrics vLLM also exports: these take the chosen prefix (the rest stay kvscope:).
VLLM_NAMED = frozenset((
    "kv_cache_usage_perc", "num_requests_running", "num_requests_waiting",
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
    "generation_tokens", "request_success", "time_to_first_token_seconds",
    "e2e_request_latency_seconds", "request_time_per_output_token_seconds",
    "inter_token_latency_seconds",
    # vLLM's tiered KV offloading (vllm/v1/kv_offload/tiering/base.py), label ``tier``
    "kv_offload_tiering_block_hits", "kv_offload_tiering_read_bytes",
    "kv_offload_tiering_read_time", "kv_offload_tiering_write_bytes",
    "kv_offload_tiering_write_time"))
# Per-tier counters (short name -> help), label ``tier`` = gpu | cpu | disk; a tier is
# exported only when the engine has it (``tier_figures``).
TIER_COUNTERS = {
    "kv_offload_tiering_block_hits": "KV blocks a prefix lookup served from the tier (gpu: "
                                     "prefix hits; cpu: host hits, blocks that arrived from "
                                     "disk included; disk: blocks read back intact)",
    "kv_offload_tiering_read_bytes": "bytes read from the tier towards the GPU",
    "kv_offload_tiering_read_time": "seconds spent reading from the tier (disk: the reader "
                                    "thread's time)",
    "kv_offload_tiering_write_bytes": "bytes written to the tier",
    "kv_offload_tiering_write_time": "seconds spent writing to the tier (disk: the writer "
                                     "thread's time)",
    "kv_tier_stored_blocks": "KV blocks stored into the tier (cpu: gpu evictions written "
                             "back; disk: host evictions and the drain's writes)",
    "kv_tier_dropped_blocks": "KV blocks the tier did not keep: disk writes that failed or "
                              "were dropped because the writer's queue was full",
    "kv_tier_load_misses": "reads that found no intact file (torn, corrupt, gone): recomputed",
    "kv_prefetch_blocks": "disk blocks a waiting request started reading (prefetch)",
    "kv_prefetch_timeouts": "requests that waited the bounded time for their prefetch and "
                            "then recomputed what had not arrived",
    "kv_tier_read_timeouts": "disk reads abandoned because they did not finish in time "
                             "(each a miss; several in a row turn the tier off)",
}
# Per-tier gauges, exported like TIER_COUNTERS.
TIER_GAUGES = {
    "kv_tier_disabled": "1 when the tier was turned off after failing (disk: an I/O error, "
                        "a full disk or reads that kept timing out; serving goes on "
                        "without it), else 0",
}
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# context_tokens label: [lower, upper) ranges of the decoding sequence's context length
CONTEXT_BOUNDS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
CONTEXT_RANGES = tuple(f"{lo}-{hi - 1}" for lo, hi in zip((0, *CONTEXT_BOUNDS[:-1]),
                                                           CONTEXT_BOUNDS, strict=True)) \
    + (f"{CONTEXT_BOUNDS[-1]}+",)


def context_range(tokens: int) -> str:
    """The ``context_tokens`` label of a context of ``tokens`` positions."""
    return CONTEXT_RANGES[bisect.bisect_right(CONTEXT_BOUNDS, tokens)]


E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0)


class _EngineCollector:
    """Exposes the latest engine snapshot (a dict replaced whole, so reads are atomic)."""

    def __init__(self, name: Any, labels: dict[str, str]) -> None:
        self.snapshot: dict[str, Any] = {}
        self.name = name  # short name -> full metric name
        self.labels = labels

    def collect(self):  # noqa: ANN201 - prometheus-client's collector protocol
        s = self.snapshot
        keys, values = list(self.labels), list(self.labels.values())
        gauges = {
            "kv_cache_usage_perc": ("fraction of GPU-tier KV blocks in use (0..1)", "usage"),
            "num_requests_running": ("requests in the running batch", "running"),
            "num_requests_waiting": ("requests waiting to be scheduled", "waiting"),
            "num_requests_swapped": ("requests swapped out to the CPU tier", "swapped"),
            "kv_cache_num_blocks": ("KV blocks in the GPU tier", "num_blocks"),
            "cpu_cache_usage_perc": ("fraction of CPU-tier KV blocks in use (0..1)",
                                     "cpu_usage"),
            "kv_cache_fragmentation_perc": ("slots of used GPU blocks holding no token "
                                            "(internal fragmentation, 0..1)", "fragmentation"),
            "event_recording_failed": ("1 once the event recording (--record) stopped on a "
                                       "write error such as a full disk; the live event "
                                       "stream goes on", "recording_failed"),
        }
        for name, (doc, key) in gauges.items():
            g = GaugeMetricFamily(self.name(name), doc, labels=keys)
            g.add_metric(values, float(s.get(key, 0)))
            yield g
        counters = {
            "prefix_cache_queries": ("prompt tokens looked up in the prefix cache",
                                     "query_tokens"),
            "prefix_cache_hits": ("prompt tokens served from the prefix cache", "hit_tokens"),
            "num_preemptions": ("sequence preemptions", "preemptions"),
            "kv_cache_evictions": ("cached KV blocks evicted for reuse", "evictions"),
            "swap_out_blocks": ("KV blocks swapped out to the CPU tier", "swap_out_blocks"),
            "swap_in_blocks": ("KV blocks swapped in from the CPU tier", "swap_in_blocks"),
            "prefill_computed_tokens": ("prompt/history tokens computed (prefill chunks)",
                                        "prefill_tokens"),
            "recomputed_prefill_tokens": ("prefill tokens computed again after a preemption "
                                          "freed them (engine.events.analysis.lifecycle)",
                                          "recomputed_tokens"),
        }
        for name, (doc, key) in counters.items():
            c = CounterMetricFamily(self.name(name), doc, labels=keys)
            c.add_metric(values, float(s.get(key, 0)))
            yield c
        tiers: dict[str, dict[str, float]] = s.get("tiers", {})
        for name, doc in TIER_COUNTERS.items():
            c = CounterMetricFamily(self.name(name), doc, labels=[*keys, "tier"])
            for tier, figures in tiers.items():
                if name in figures:
                    c.add_metric([*values, tier], float(figures[name]))
            yield c
        for name, doc in TIER_GAUGES.items():
            g = GaugeMetricFamily(self.name(name), doc, labels=[*keys, "tier"])
            for tier, figures in tiers.items():
                if name in figures:
                    g.add_metric([*values, tier], float(figures[name]))
            yield g


def tier_figures(engine: Any, m: dict[str, Any]) -> dict[str, dict[str, float]]:
    """The per-tier counters (``TIER_COUNTERS``) of ``engine``: gpu always; cpu with a host
    tier (the swapper's copies); disk with a disk tier (the cache's disk bookkeeping and
    the runner's reader/writer threads). ``m``: the cache's metrics()."""
    bs = engine.cache.block_size
    host_hits = m.get("host_hit_tokens", 0) // bs
    out = {"gpu": {"kv_offload_tiering_block_hits":
                   (m["prefix_hit_tokens"] // bs) - host_hits}}
    swapper = getattr(engine, "swapper", None)
    if swapper is not None:
        sw = swapper.stats()
        out["cpu"] = {"kv_offload_tiering_block_hits": host_hits,
                      "kv_offload_tiering_read_bytes": sw["swap_in_bytes"],
                      "kv_offload_tiering_write_bytes": sw["swap_out_bytes"],
                      "kv_tier_stored_blocks": m.get("offloaded_blocks", 0)}
    disk_io, disk = getattr(engine, "disk_io", None), getattr(engine.cache, "disk", None)
    if disk_io is not None and disk is not None:
        io = disk_io.stats
        out["disk"] = {"kv_offload_tiering_block_hits": disk.arrived_blocks,
                       "kv_offload_tiering_read_bytes": io.bytes_read,
                       "kv_offload_tiering_read_time": io.read_s,
                       "kv_offload_tiering_write_bytes": io.bytes_written,
                       "kv_offload_tiering_write_time": io.write_s,
                       "kv_tier_stored_blocks": disk.stored_blocks,
                       "kv_tier_dropped_blocks": disk.write_failures,
                       "kv_tier_load_misses": disk.read_misses,
                       "kv_prefetch_blocks": disk.prefetched_blocks,
                       "kv_prefetch_timeouts": disk.prefetch_timeouts,
                       "kv_tier_read_timeouts": io.read_timeouts,
                       "kv_tier_disabled": float(disk_io.store.disabled or not disk.enabled)}
    return out


class ServerMetrics:
    """One registry per server (tests may run several in one process)."""

    def __init__(self, model_name: str, prefix: str = "kvscope") -> None:
        if prefix not in METRICS_PREFIXES:
            raise ValueError(f"metrics prefix must be one of {METRICS_PREFIXES}, got {prefix!r}")
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.prefix = prefix
        vllm = prefix == "vllm"
        # vLLM labels every series with the served model and the engine index
        self._labels = {"model_name": model_name, "engine": "0"} if vllm else {}
        self._engine = _EngineCollector(self._name, self._labels)
        self.registry.register(self._engine)
        r, ln = self.registry, list(self._labels)

        def labelled(metric: Any) -> Any:
            return metric.labels(**self._labels) if self._labels else metric

        tpot = "request_time_per_output_token_seconds" if vllm else "time_per_output_token_seconds"
        self.ttft = labelled(Histogram(self._name("time_to_first_token_seconds"),
                                       "time from arrival to the first output token",
                                       ln, buckets=TTFT_BUCKETS, registry=r))
        self.tpot = labelled(Histogram(self._name(tpot),
                                       "mean time between output tokens of a finished request",
                                       ln, buckets=TPOT_BUCKETS, registry=r))
        self.itl = labelled(Histogram(self._name("inter_token_latency_seconds"),
                                      "time between consecutive output tokens",
                                      ln, buckets=ITL_BUCKETS, registry=r)) if vllm else None
        self.e2e = labelled(Histogram(self._name("e2e_request_latency_seconds"),
                                      "time from arrival to finish", ln,
                                      buckets=E2E_BUCKETS, registry=r))
        self.prompt_tokens = labelled(Counter(self._name("prompt_tokens"),
                                              "prompt tokens of finished requests", ln,
                                              registry=r))
        self.generation_tokens = labelled(Counter(self._name("generation_tokens"),
                                                  "generated tokens of finished requests", ln,
                                                  registry=r))
        self._success = Counter(self._name("request_success"),
                                "finished requests by finish reason",
                                [*ln, "finished_reason"], registry=r)
        if vllm:  # as vLLM: every finish reason is a series from the start (at 0)
            for reason in FINISH_REASONS:
                self._success.labels(**self._labels, finished_reason=reason)
        self.aborted = Counter(P + "request_aborted", "aborted requests by reason",
                               ["reason"], registry=r)
        self.decode_by_context = Histogram(
            P + "time_per_output_token_by_context_seconds",
            "engine step time per decoded token, by the sequence's context length "
            "(latency creep)", [*ln, "context_tokens"], buckets=ITL_BUCKETS, registry=r)
        self._last_step_end: float | None = None

    def _name(self, short: str) -> str:
        """The exported name: vLLM's metrics under the chosen prefix, kvscope's own under
        ``kvscope:``."""
        return (self.prefix + ":" if short in VLLM_NAMED else P) + short

    # -------------------------------------------------- engine-thread hooks
    def on_step(self, engine: Any) -> None:
        st = StepStats.read(engine.stats)
        now = time.monotonic()
        if self.itl is not None:
            decoded = st.decode_tokens or 0
            if decoded and self._last_step_end is not None:
                gap = now - self._last_step_end
                for _ in range(decoded):
                    self.itl.observe(gap)
            self._last_step_end = now if engine.has_unfinished_requests() else None
        step_time = st.step_time_s
        if step_time is not None:
            for ctx in getattr(engine, "decode_contexts", ()):
                self.decode_by_context.labels(
                    **self._labels, context_tokens=context_range(ctx)).observe(step_time)
        m = engine.cache.metrics()
        gpu = m["tiers"].get("gpu", {"total": 0, "used": 0})
        cpu = m["tiers"].get("cpu")
        idle = not engine.has_unfinished_requests()  # stats are per step: stale when idle
        self._engine.snapshot = {
            "usage": gpu["used"] / max(1, gpu["total"]),
            "num_blocks": gpu["total"],
            "cpu_usage": cpu["used"] / max(1, cpu["total"]) if cpu else 0.0,
            "running": 0 if idle else st.running or 0,
            "waiting": 0 if idle else st.waiting or 0,
            "swapped": 0 if idle else st.swapped or 0,
            "query_tokens": m["prefix_query_tokens"],
            "hit_tokens": m["prefix_hit_tokens"],
            "preemptions": m.get("preemptions", 0) if st.preemptions is None
            else st.preemptions,
            "evictions": m["evictions"],
            # Cumulative swap counts, once the CPU swap tier reports them in its stats.
            "swap_out_blocks": st.swap_out_blocks or 0,
            "swap_in_blocks": st.swap_in_blocks or 0,
            "prefill_tokens": getattr(engine, "num_prefill_computed_tokens", 0),
            "recomputed_tokens": getattr(engine, "num_recomputed_tokens", 0),
            "tiers": tier_figures(engine, m),
            "recording_failed": float(getattr(getattr(engine, "events", None),
                                              "recording_error", None) is not None),
            "fragmentation": 1 - m["used_tokens"] / (gpu["used"] * engine.cache.block_size)
            if gpu["used"] else 0.0,
        }

    def on_finish(self, out: RequestOutput) -> None:
        m = out.metrics
        if m is None:
            return
        if m.time_to_first_token is not None:
            self.ttft.observe(m.time_to_first_token)
        if m.time_per_output_token is not None:
            self.tpot.observe(m.time_per_output_token)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.generation_tokens.inc(m.num_generation_tokens)
        # One count per request (as vLLM), labelled by its first completion's reason.
        self._success.labels(**self._labels,
                             finished_reason=out.outputs[0].finish_reason or "unknown").inc()

    def on_abort(self, reason: str) -> None:
        self.aborted.labels(reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
