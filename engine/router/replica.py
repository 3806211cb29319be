"""Replica: one ``kvscope serve`` behind the router: its HTTP address, a Subscriber on its
event stream (the KVState mirror and the PrefixIndex built from it), its health and load.

A replica is in rotation only while its last /health answered 200 and (when it has an
event stream) the subscriber holds a snapshot and has heard from it within
``stale_after_s`` (the publisher's heartbeat is ~1 s). A restart shows up as a new epoch:
the subscriber installs the new publisher's snapshot and the index is rebuilt from it,
so an old cache is never trusted. While a replica is out, nothing is routed to it; the
requests it was serving fail with a clear error and nobody else's are touched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvscope.engine.events.stats import StepStats
from kvscope.engine.router.prefix_index import PrefixIndex, prompt_chain


def parse_replica(spec: str) -> tuple[str, str | None, str | None]:
    """``URL[,EVENTS[,SNAPSHOT]]`` -> (url, events endpoint, snapshot endpoint)."""
    parts = [p.strip() for p in spec.split(",")]
    if not parts[0].startswith(("http://", "https://")) or len(parts) > 3 or \
            any(not p for p in parts):
        raise ValueError(f"bad --replica {spec!r}: expected URL[,EVENTS[,SNAPSHOT]], e.g. "
                         "http://127.0.0.1:8001,tcp://127.0.0.1:5557")
    url = parts[0].rstrip("/")
    return url, (parts[1] if len(parts) > 1 else None), (parts[2] if len(parts) > 2 else None)


@dataclass
class ReplicaCounters:
    routed: int = 0  # routing decisions that picked this replica
    failed: int = 0  # requests that failed because the replica did (connection lost, 5xx)
    retried: int = 0  # of those, lost before any answer and sent again to another replica
    prompt_tokens: int = 0  # from usage, for requests that reported it
    predicted_cached_tokens: int = 0
    actual_cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens
    reported: int = 0  # requests whose usage came back (predicted vs actual is over these)
    predicted_reported: int = 0  # the predictions of those requests


class Replica:
    def __init__(self, name: str, url: str, events: str | None = None,
                 snapshot: str | None = None, stale_after_s: float = 3.0,
                 keys: str | None = None) -> None:
        self.name = name
        self.url = url
        self.events = events
        self.snapshot_endpoint = snapshot
        self.index = PrefixIndex()
        self.healthy = False  # the last /health check answered 200
        self.health_error = "not checked yet"
        self.in_flight = 0  # requests the router has open on it
        self.counters = ReplicaCounters()
        self.block_size: int | None = None  # from the publisher's header
        self.prefix_caching = True
        self.epoch: str | None = None
        self.epochs_seen = 0  # starts of its publisher (1 = the first we joined)
        self.stats = StepStats()  # of the last batch applied
        self.sub = None
        if events is not None:
            from kvscope.engine.events.wire.subscriber import Subscriber

            self.sub = Subscriber(events, snapshot, on_apply=self._on_apply,
                                  stale_after_s=stale_after_s, keys=keys)

    # ---------------------------------------------------------- event stream
    def start(self) -> None:
        if self.sub is not None:
            self.sub.start()

    def close(self) -> None:
        if self.sub is not None:
            self.sub.close()

    def _on_apply(self, update: dict[str, Any], state: Any) -> None:
        """Runs on the subscriber's thread, under its lock, after each applied update."""
        if update.get("type") == "snapshot":
            info = update.get("info") or {}
            cfg = info.get("config") if isinstance(info.get("config"), dict) else {}
            bs = cfg.get("block_size")
            if isinstance(bs, int) and bs > 0:
                self.block_size = bs
            if "enable_prefix_caching" in cfg:
                self.prefix_caching = bool(cfg["enable_prefix_caching"])
            if update.get("epoch") != self.epoch:
                self.epoch = update.get("epoch")
                self.epochs_seen += 1
            self.index.rebuild(state)
        else:
            self.index.on_batch(update, state)
        self.stats = StepStats.read(getattr(state, "stats", None))

    @property
    def stream_status(self) -> str:
        """"none" (no event stream), "waiting", "connected" or "stale"."""
        return "none" if self.sub is None else self.sub.status

    @property
    def in_rotation(self) -> bool:
        return self.healthy and self.stream_status in ("none", "connected")

    # --------------------------------------------------------------- routing
    @property
    def load(self) -> int:
        """Requests queued or running here: the router's own open requests, or the engine's
        running + waiting when others send it work too (whichever is larger)."""
        s = self.stats
        engine = 0
        if s.running is not None and s.waiting is not None:
            engine = s.running + s.waiting
        return max(self.in_flight, engine)

    def predicted_cached_tokens(self, token_ids: list[int] | None) -> int:
        """Prompt tokens this replica would serve from its prefix cache now (0 without an
        event stream, prefix caching off, or before its snapshot)."""
        if not token_ids or self.sub is None or self.block_size is None or \
                not self.prefix_caching:
            return 0
        chain = prompt_chain(token_ids, self.block_size)
        with self.sub.lock:
            return self.index.matched_blocks(chain) * self.block_size

    def cached_blocks(self) -> int:
        if self.sub is None:
            return 0
        with self.sub.lock:
            return len(self.index)

    def restarts(self) -> int:
        return max(self.epochs_seen - 1, 0)

    def describe(self) -> dict[str, Any]:
        c = self.counters
        return {"name": self.name, "url": self.url, "events": self.events,
                "in_rotation": self.in_rotation, "healthy": self.healthy,
                "health_error": None if self.healthy else self.health_error,
                "stream": self.stream_status, "epoch": self.epoch,
                "restarts": self.restarts(), "block_size": self.block_size,
                "cached_blocks": self.cached_blocks(), "in_flight": self.in_flight,
                "load": self.load, "routed": c.routed, "failed": c.failed, "retried": c.retried,
                "prompt_tokens": c.prompt_tokens,
                "predicted_cached_tokens": c.predicted_reported,
                "actual_cached_tokens": c.actual_cached_tokens,
                "hit_rate": (c.actual_cached_tokens / c.prompt_tokens
                             if c.prompt_tokens else None)}
