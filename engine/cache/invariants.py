"""check_invariants: prove the cache manager's bookkeeping is consistent (tests call it
after every operation; it is O(blocks + table entries), not for the hot path)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.cache.manager import KVCacheManager


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


def check_invariants(m: KVCacheManager) -> None:
    bs = m.block_size
    for name, pool in m.pools.items():
        free, evictable = pool.free_blocks, pool.evictable
        free_set = set(free)
        _require(len(free_set) == len(free), f"{name}: a block is twice on the free stack")
        holders = Counter(
            b for s in m._seqs.values() if name == "gpu" for b in s.block_table
        )
        for b in range(pool.num_blocks):
            ref, entry = pool.ref[b], pool.entry[b]
            # ref counts = block-table entries (the prefix index holds no reference)
            _require(ref == holders.get(b, 0), f"{name}: block {b} ref {ref} != "
                     f"{holders.get(b, 0)} table entries")
            states = (b in evictable) + (ref > 0) + (b in free_set)
            _require(states == 1, f"{name}: block {b} is in {states} of free/cached/used")
            if b in evictable:
                _require(entry is not None, f"{name}: evictable block {b} has no hash")
            if b in free_set:
                _require(entry is None, f"{name}: free block {b} is still hashed")
            if entry is not None:
                _require(pool.cached.get(entry[0]) == b,
                         f"{name}: block {b}'s hash is not indexed to it")
                _require(len(entry[2]) == bs, f"{name}: cached block {b} is not full")
        _require(len(free) + len(evictable) + pool.num_used_blocks == pool.num_blocks,
                 f"{name}: free + cached + used != total")
        for h, b in pool.cached.items():
            e = pool.entry[b]
            _require(e is not None and e[0] == h, f"{name}: index maps {h} to block {b} "
                     "which holds another hash")
    for sid, s in m._seqs.items():
        _require(s.num_tokens >= 0, f"{sid}: negative token count")
        _require(len(s.block_table) == -(-s.num_tokens // bs),
                 f"{sid}: {len(s.block_table)} blocks for {s.num_tokens} tokens")
        _require(len(set(s.block_table)) == len(s.block_table), f"{sid}: a block twice")
        _require(len(s.chain_hashes) == len(s.chain_ids) == s.num_stored,
                 f"{sid}: chain of {len(s.chain_hashes)} for {s.num_stored} stored blocks")
        _require(s.num_stored <= min(s.num_tokens, len(s.token_ids)) // bs,
                 f"{sid}: {s.num_stored} blocks offered to the index beyond the known tokens")
        if m.enable_prefix_caching:
            _require(s.num_stored == min(s.num_tokens, len(s.token_ids)) // bs,
                     f"{sid}: a full, known block was not offered to the prefix index")
        for i in range(s.num_stored):
            e = m.gpu.entry[s.block_table[i]]
            if e is not None:
                _require(e[0] == s.chain_hashes[i], f"{sid}: block {i} hash disagrees")
                _require(e[2] == tuple(s.token_ids[i * bs:(i + 1) * bs]),
                         f"{sid}: cached block {i} holds other tokens")
        if s.num_tokens % bs:
            last = s.block_table[-1]
            _require(m.gpu.entry[last] is None, f"{sid}: its partial last block is hashed")
            for o in m._seqs.values():
                if o.block_table and o.block_table[-1] == last:
                    _require(o.num_tokens % bs == s.num_tokens % bs,
                             f"{sid}: shared partial block {last} filled differently")
        _require(s.status in ("waiting", "running", "swapped"), f"{sid}: bad status")
