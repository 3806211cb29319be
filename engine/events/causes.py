"""Why a sequence was preempted and why blocks were evicted: the optional ``cause`` field
of ``seq_preempt`` and ``evict`` events (engine.events.schema), and its one-line text.

The engine fills a cause where the decision is made: the scheduler for a preemption (it
alone knows who needed blocks and how it picked the victim), the block pool for an
eviction (it alone knows how many blocks an allocation asked for and how many were free
without evicting). Readers that do not know the field ignore it; every key is optional
to a reader, since recordings from older engines have no causes at all.

Torch-free.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

# cause keys (the wire names)
NEEDED_BY = "needed_by"  # the sequence whose allocation forced the decision (or None)
BLOCKS_NEEDED = "blocks_needed"  # blocks that allocation asked for
FREE_BLOCKS = "free_blocks"  # blocks it could take at that moment (preempt: free+cached;
#                              evict: uncached free only, since cached ones are the victims)
POLICY = "policy"  # the rule that picked the victim (preemption order or eviction policy)
REASON = "reason"  # what kind of allocation it was (REASONS below)
FALLBACK = "fallback"  # preempt only: a swap preemption done as recompute (host full)

# reasons
R_ALLOCATE = "allocate"  # a running or admitted sequence's next tokens
R_FORK = "fork"  # private copies for a forked child
R_SWAP_IN = "swap_in"  # a swapped sequence's table coming back
R_SWAP_OUT = "swap_out"  # host blocks for a preempted sequence's table
R_HOST_HIT = "host_hit"  # gpu blocks to load a host-cached prefix into
R_WRITE_BACK = "write_back"  # host blocks for evicted gpu blocks (write-back cache)
R_RESET = "reset"  # an explicit prefix-cache reset (evict_cached), not an allocation
R_PREFETCH = "prefetch"  # host blocks for disk reads that arrived (engine.cache.disk_tier)
R_DISK_FAILED = "disk_failed"  # a disk block whose write or read failed leaves the index
REASONS = (R_ALLOCATE, R_FORK, R_SWAP_IN, R_SWAP_OUT, R_HOST_HIT, R_WRITE_BACK, R_RESET,
           R_PREFETCH, R_DISK_FAILED)

# how each decision picks its victim (the text the inspector shows)
PREEMPT_RULE = "lowest priority, latest arrival (not yet scheduled this step)"
EVICT_RULES = {
    "lru": "least recently freed first",
    "lfu": "least frequently used (LFU with dynamic aging)",
    "priority": "lowest retention priority, then least recently freed",
    # a hybrid cache's window block whose content group 0 just evicted: no hit can reach
    # it any more (engine.cache.window_group)
    "twin": "its full-attention twin was evicted",
}


class Cause(msgspec.Struct, kw_only=True, omit_defaults=True, gc=False):
    """The ``cause`` map's type (the keys above; every one optional, see the module
    docstring). Emitters build the map itself (``{NEEDED_BY: ..., ...}``)."""

    needed_by: str | None | UnsetType = UNSET
    blocks_needed: int | UnsetType = UNSET
    free_blocks: int | UnsetType = UNSET
    policy: str | UnsetType = UNSET
    reason: str | UnsetType = UNSET
    fallback: str | UnsetType = UNSET


def describe(cause: Any, kind: str = "seq_preempt", victim: str | None = None) -> str:
    """One line for a tooltip: "needed by req88: 6 blocks, 0 free; victim: lowest
    priority, latest arrival". Tolerates missing keys and non-dict input (old or hostile
    recordings): what is unknown is said to be unknown. ``victim``: the preempted
    sequence, to say when it was preempted for its own growth."""
    if not isinstance(cause, dict):
        return "cause not recorded"
    who = cause.get(NEEDED_BY)
    reason = cause.get(REASON)
    need, free = cause.get(BLOCKS_NEEDED), cause.get(FREE_BLOCKS)
    parts = []
    if reason == R_RESET:
        parts.append("prefix cache reset")
    else:
        head = f"{who}{' (itself)' if who and who == victim else ''} needed" if who \
            else "an allocation needed"
        if need is not None:
            head += f" {need} block{'s' if need != 1 else ''}"
        if free is not None:
            head += f", {free} free"
        if reason and reason != R_ALLOCATE:
            head += f" ({reason.replace('_', '-')})"
        parts.append(head)
    policy = cause.get(POLICY)
    if policy:
        rule = EVICT_RULES.get(policy, policy) if kind == "evict" else policy
        parts.append(f"victim: {rule}")
    if cause.get(FALLBACK):
        parts.append(str(cause[FALLBACK]))
    return "; ".join(parts)
