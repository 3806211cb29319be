"""Routing policies: which replica in rotation gets the next request.

    round-robin   each in turn
    least-load    the fewest requests queued or running (``Replica.load``)
    prefix        the longest cached prefix of the prompt (predicted from each replica's
                  PrefixIndex), among replicas whose load is within ``balance_slack`` of
                  the least loaded; with no cached prefix anywhere, least-load

The prefix rule is SGLang's cache-aware routing in its simplest form: a cache hit saves
prefill work only if the replica is not so busy that the request queues behind others,
so load bounds which replicas may compete on cache. Ties go round-robin, so equal
replicas share the work.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from engine.router.replica import Replica

POLICIES = ("prefix", "least-load", "round-robin")


@dataclass
class Decision:
    replica: Replica
    predicted_cached_tokens: int
    reason: str  # "prefix", "least-load" or "round-robin": the rule that picked it


class Policy:
    def __init__(self, name: str, balance_slack: int = 2) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
        self.name = name
        self.balance_slack = balance_slack
        self._turn = itertools.count()

    def choose(self, replicas: list[Replica], token_ids: list[int] | None) -> Decision | None:
        """The replica for a prompt (None: no replica is in rotation)."""
        up = [r for r in replicas if r.in_rotation]
        if not up:
            return None
        # Rotate the candidate order each call: every tie below then goes round-robin.
        k = next(self._turn) % len(up)
        up = up[k:] + up[:k]
        if self.name == "round-robin":
            r = up[0]
            return Decision(r, r.predicted_cached_tokens(token_ids), "round-robin")
        loads = [r.load for r in up]
        least = min(range(len(up)), key=loads.__getitem__)
        predicted = [r.predicted_cached_tokens(token_ids) for r in up]
        if self.name == "prefix":
            limit = loads[least] + self.balance_slack
            best = max((i for i in range(len(up)) if loads[i] <= limit),
                       key=lambda i: (predicted[i], -loads[i]))
            if predicted[best] > 0:
                return Decision(up[best], predicted[best], "prefix")
        return Decision(up[least], predicted[least], "least-load")
