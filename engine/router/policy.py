"""Routing policies: which replica in rotation gets the next request.

    round-robin   each in turn
    least-load    the fewest requests queued or running (``Replica.load``)
    prefix        the least estimated work before the first token: the prompt tokens the
                  replica would still have to compute (its cached prefix, predicted from
                  its PrefixIndex, is free) plus ``load_cost_tokens`` for each request
                  already queued or running there; with no cached prefix anywhere,
                  least-load

The prefix rule is SGLang's cache-aware routing with the load in the same unit as the
cache: a long cached history keeps a conversation on its replica, a shared system
prompt cached everywhere does not pull every new conversation onto the busiest replica.
Ties go round-robin, so equal replicas share the work.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from kvscope.engine.router.replica import Replica

POLICIES = ("prefix", "least-load", "round-robin")


@dataclass
class Decision:
    replica: Replica
    predicted_cached_tokens: int
    reason: str  # "prefix", "least-load" or "round-robin": the rule that picked it


class Policy:
    def __init__(self, name: str, load_cost_tokens: int = 32) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
        self.name = name
        self.load_cost_tokens = load_cost_tokens
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
        if self.name == "prefix" and max(predicted) > 0:
            n = len(token_ids or ())
            cost = [n - predicted[i] + self.load_cost_tokens * loads[i] for i in range(len(up))]
            best = min(range(len(up)), key=cost.__getitem__)
            return Decision(up[best], predicted[best], "prefix")
        return Decision(up[least], predicted[least], "least-load")
