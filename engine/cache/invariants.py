"""check_invariants: prove the cache manager's bookkeeping is consistent (tests call it
after every operation; it is O(blocks + table entries), not for the hot path)."""

from __future__ import annotations

from itertools import compress
from typing import TYPE_CHECKING

from kvscope.engine.cache.hashing import chain_hashes

if TYPE_CHECKING:
    from kvscope.engine.cache.view import CacheView


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


def check_invariants(m: CacheView) -> None:
    """Per tier: ref counts equal the block-table entries of the sequences whose table is
    in that tier; every block is exactly one of free / cached free / used; the hash index
    and the entries agree. Per sequence: its table is in the tier its status implies
    (swapped <=> cpu) and its indexed blocks hold its own chain of hashes and tokens."""
    bs = m.block_size
    for name, pool in m.pools.items():
        n, ref, entry, evictable = pool.num_blocks, pool.ref, pool.entry, pool.evictable
        free_set = set(pool.free_blocks)
        _require(len(free_set) == len(pool.free_blocks), f"{name}: a block twice on the free stack")
        _require(len(ref) == len(entry) == n, f"{name}: per-block lists resized")
        # ref counts = block-table entries (the prefix index holds no reference)
        expected = [0] * n
        for s in m.sequences.values():
            if s.tier == name:
                for b in s.block_table:
                    expected[b] += 1
        if ref != expected:
            b = next(b for b in range(n) if ref[b] != expected[b])
            _require(False, f"{name}: block {b} ref {ref[b]} != {expected[b]} table entries")
        # every block is exactly one of free / cached free / used
        _require(min(ref, default=0) >= 0, f"{name}: a negative ref count")
        cached_free = set(evictable)
        used = set(compress(range(n), ref))
        disk = m.disk
        if disk is not None and pool is disk.disk:  # blocks being read: out of the order
            pinned = set(disk.inflight)
            _require(all(map(entry.__getitem__, pinned)), "disk: a block read is not hashed")
            _require(not pinned & cached_free, "disk: a block being read is evictable")
            used |= pinned
            _require(not disk.pending - set(pool.cached.values()),
                     "disk: a pending write for a block not indexed")
        _require(len(cached_free) == len(evictable)
                 and all(0 <= b < n for b in (min(cached_free, default=0),
                                              max(cached_free, default=0))),
                 f"{name}: the policy's blocks disagree with its length or the pool")
        _require(len(free_set) + len(cached_free) + len(used) == n
                 and len(free_set | cached_free | used) == n,
                 f"{name}: free + cached + used != total, or a block in two states")
        _require(all(map(entry.__getitem__, cached_free)), f"{name}: an evictable block has "
                 "no hash")
        _require(not any(map(entry.__getitem__, free_set)), f"{name}: a free block is hashed")
        # the hash index and the blocks agree, one block per hash
        _require(n - entry.count(None) == len(pool.cached),
                 f"{name}: {len(pool.cached)} indexed hashes for a different number of blocks")
        for h, b in pool.cached.items():
            e = entry[b]
            _require(e is not None and e[0] == h and len(e[2]) == bs,
                     f"{name}: index maps {h} to block {b}, which holds {e!r}")
        if hasattr(pool, "check_frames"):  # mixed-precision pool: pages and frames agree
            pool.check_frames()
    for sid, s in m.sequences.items():
        pool = m.pools.get(s.tier)
        _require(pool is not None, f"{sid}: table in missing tier {s.tier!r}")
        _require((s.status == "swapped") == (s.tier == "cpu"),
                 f"{sid}: status {s.status} with its table in tier {s.tier}")
        _require(s.num_tokens >= 0, f"{sid}: negative token count")
        _require(len(s.block_table) == -(-s.num_tokens // bs),
                 f"{sid}: {len(s.block_table)} blocks for {s.num_tokens} tokens")
        _require(len(set(s.block_table)) == len(s.block_table), f"{sid}: a block twice")
        _require(s.num_stored <= min(s.num_tokens, len(s.token_ids)) // bs,
                 f"{sid}: {s.num_stored} blocks offered to the index beyond the known tokens")
        if m.enable_prefix_caching:
            _require(s.tier == "cpu"  # swapped: its blocks are offered when it swaps in
                     or s.num_stored == min(s.num_tokens, len(s.token_ids)) // bs,
                     f"{sid}: a full, known block was not offered to the prefix index")
            # the manager's inlined hashing is the documented chain
            chain = chain_hashes(s.token_ids[:s.num_stored * bs], bs, s.cache_salt)
            _require(s.chain_hash == (chain[-1] if chain else s.root_hash),
                     f"{sid}: chain tip disagrees with hashing.chain_hashes")
            for i, h in enumerate(chain):
                e = pool.entry[s.block_table[i]]
                tokens = tuple(s.token_ids[i * bs:(i + 1) * bs])
                _require(e is None or (e[0] == h and e[2] == tokens),
                         f"{sid}: cached block {i} holds another hash or other tokens")
        if s.num_tokens % bs:
            last = s.block_table[-1]
            _require(pool.entry[last] is None, f"{sid}: its partial last block is hashed")
            for o in m.sequences.values():
                if o.tier == s.tier and o.block_table and o.block_table[-1] == last:
                    _require(o.num_tokens % bs == s.num_tokens % bs,
                             f"{sid}: shared partial block {last} filled differently")
        _require(s.status in ("waiting", "running", "swapped"), f"{sid}: bad status")
    window = getattr(m, "window", None)
    if window is not None:  # the sliding-window group (engine.cache.window_group)
        window.check(list(m.sequences.values()))
        for sid, s in m.sequences.items():
            _require(s.window_first >= 0 and s.window_first <= window.first_kept(
                max(0, s.num_tokens - 1)), f"{sid}: window blocks released too early")
