"""The router's /metrics: per-replica routing decisions, failures, predicted vs actual
cached prompt tokens, and each replica's state (in rotation, load, cached blocks,
restarts), in Prometheus text under ``kvscope:router_``. Everything is read from the
replicas' counters at scrape time, so a scrape is always consistent with /router/replicas.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "kvscope:router_"


class _Collector:
    def __init__(self, router: Any) -> None:
        self.router = router

    def collect(self):  # noqa: ANN201 - prometheus-client's collector protocol
        r = self.router
        decisions = CounterMetricFamily(P + "decisions", "requests routed, by replica and "
                                        "by the rule that picked it", labels=["replica",
                                                                              "reason"])
        for (name, reason), n in sorted(r.decisions.items()):
            decisions.add_metric([name, reason], n)
        yield decisions
        counters = {
            "requests": ("requests routed to the replica", lambda c: c.routed),
            "failed_requests": ("requests that failed because the replica failed",
                                lambda c: c.failed),
            "retried_requests": ("of those, requests lost before any answer reached the "
                                 "client and sent again to another replica",
                                 lambda c: c.retried),
            "prompt_tokens": ("prompt tokens of requests whose usage came back",
                              lambda c: c.prompt_tokens),
            "predicted_cached_tokens": ("cached prompt tokens the router predicted, over "
                                        "requests whose usage came back",
                                        lambda c: c.predicted_reported),
            "actual_cached_tokens": ("usage.prompt_tokens_details.cached_tokens",
                                     lambda c: c.actual_cached_tokens),
        }
        for key, (doc, get) in counters.items():
            fam = CounterMetricFamily(P + key, doc, labels=["replica"])
            for rep in r.replicas:
                fam.add_metric([rep.name], get(rep.counters))
            yield fam
        restarts = CounterMetricFamily(P + "replica_restarts", "new publisher epochs seen",
                                       labels=["replica"])
        gauges = {
            "replica_up": ("1 while the replica is in rotation", lambda x: int(x.in_rotation)),
            "replica_load": ("requests queued or running on the replica", lambda x: x.load),
            "replica_in_flight": ("requests the router has open on it",
                                  lambda x: x.in_flight),
            "replica_cached_blocks": ("blocks in its prefix index", lambda x: x.cached_blocks()),
        }
        for rep in r.replicas:
            restarts.add_metric([rep.name], rep.restarts())
        yield restarts
        for key, (doc, get) in gauges.items():
            fam = GaugeMetricFamily(P + key, doc, labels=["replica"])
            for rep in r.replicas:
                fam.add_metric([rep.name], get(rep))
            yield fam


def render(router: Any) -> bytes:
    registry = CollectorRegistry()
    registry.register(_Collector(router))
    return generate_latest(registry)
