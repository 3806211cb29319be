"""The one exception the cache manager raises for a bad call."""

from __future__ import annotations


class CacheError(ValueError):
    """A call the KV cache manager rejects (unknown or duplicate sequence, negative count,
    wrong status, bad configuration). Raised before any state changes: the manager and the
    events it has emitted are exactly as they were before the call."""
