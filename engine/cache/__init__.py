"""The paged KV cache's bookkeeping: block pools, block tables, prefix cache, eviction.

Pure Python (no torch, no tensors): the runner turns the manager's decisions into tensor
work. Start with ``KVCacheManager`` (manager.py), whose docstring is the API contract.
"""

from kvscope.engine.cache.errors import CacheError
from kvscope.engine.cache.eviction import POLICIES, make_policy
from kvscope.engine.cache.manager import KVCacheManager
from kvscope.engine.cache.slots import slot_mapping

__all__ = ["CacheError", "KVCacheManager", "POLICIES", "make_policy", "slot_mapping"]
