"""``CacheView``: the read-only face of the cache manager that its reports read.

``report`` (snapshot, metrics), ``invariants`` and ``demotion`` take a ``CacheView``, not a
``KVCacheManager``: they read the pools and the sequences, never change them, and do not
import the manager (which imports them). ``KVCacheManager`` satisfies the protocol.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvscope.engine.cache.block_pool import BlockPool
    from kvscope.engine.cache.disk_tier import DiskTier
    from kvscope.engine.cache.host_tier import HostTier
    from kvscope.engine.cache.sequence import CacheSeq
    from kvscope.engine.cache.window_group import WindowGroup


class CacheView(Protocol):
    block_size: int
    enable_prefix_caching: bool
    pools: dict[str, BlockPool]
    gpu: BlockPool
    host: HostTier | None
    disk: DiskTier | None
    num_query_tokens: int
    num_hit_tokens: int
    num_cow_copies: int
    num_preemptions: int
    num_swap_fallbacks: int
    window: WindowGroup | None

    @property
    def sequences(self) -> Mapping[str, CacheSeq]:
        """Every known sequence by id (read-only)."""
        ...

    @property
    def num_swapped(self) -> int: ...
