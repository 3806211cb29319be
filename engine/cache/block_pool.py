"""BlockPool: one tier's physical KV blocks, their ref counts and the prefix-cache index.

Every block is in exactly one state (the inspector's colours, schema.BLOCK_*):
    free         ref 0, no hash   in ``free_blocks`` (a stack); reused first
    cached       ref 0, hashed    in ``evictable`` (the eviction policy's order); a prefix
                                  hit revives it, an allocation evicts it (lazily: only
                                  when no free block is left)
    used/shared  ref >= 1         in at least one block table; may be hashed

NOTE: ref counts count block-table entries only; the prefix index holds no reference,
which is what makes a cached block evictable exactly when its ref count reaches 0.

A cached block's ``entry`` is (hash, parent_id, tokens, serial): ``tokens`` are its token
ids and ``parent_id`` the serial of the cache entry its parent block matched when it was
stored (for a first block: the request's ``(cache_salt,)``), so a hit is verified exactly,
not trusted to a 64-bit hash (see engine.cache.hashing). ``cached`` maps hash -> block,
one block per hash: a block whose content is already indexed elsewhere stays unhashed.
The manager's match and store loops read ``cached`` and ``entry`` directly (per-block
method calls would double their cost).

The pool emits ``evict`` itself (it alone decides which cached blocks to reuse); the
manager emits the events that name a sequence. The "cpu" tier uses the same class (its
blocks hold swapped-out sequences and the host prefix cache, see engine.cache.host_tier);
``writeback``, when set, is called with every batch of evicted blocks and their entries
right after ``evict`` is emitted, before the blocks are handed out again: the gpu pool's
hook writes them back to the host tier (beside a hybrid window group, which has no host
tier, it drops their cached window twins instead).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvscope.engine.cache.eviction import EvictionPolicy
from kvscope.engine.events import causes as C
from kvscope.engine.events import schema as S
from kvscope.engine.events.sink import EventSink

Entry = tuple[int, Any, tuple[int, ...], int]  # (hash, parent_id, tokens, serial)


class BlockPool:
    def __init__(
        self, tier: str, num_blocks: int, block_size: int, kv_format: str,
        policy: EvictionPolicy, sink: EventSink,
    ) -> None:
        self.tier = tier
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_format = kv_format
        self.ref: list[int] = [0] * num_blocks
        self.entry: list[Entry | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block
        # A stack whose top is the lowest id, so a fresh pool hands out 0, 1, 2, ...
        self.free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))
        self.evictable = policy
        self.sink = sink
        self.num_evictions = 0
        self.num_stored = 0  # blocks ever indexed; also the last serial handed out
        self.writeback: Callable[[list[int], list[Entry]], None] | None = None
        # Who is allocating, and why: the manager sets these before it allocates, so an
        # eviction can name its cause (engine.events.causes) in the ``evict`` event.
        self.requester: str | None = None
        self.reason: str = C.R_ALLOCATE
        self.group = 0  # the KV cache group whose pool this is (1: a hybrid window group)

    # ---------------------------------------------------------------- counts
    @property
    def capacity(self) -> int:
        """What watermarks are shares of: blocks here, frames in a MixedBlockPool."""
        return self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free plus cached free (evictable)."""
        return len(self.free_blocks) + len(self.evictable)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks) - len(self.evictable)

    # ------------------------------------------------------------ allocation
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks (ref 1, unhashed): free blocks first, then evict cached ones.
        The caller has checked ``n <= num_free_blocks``."""
        blocks = self.take(n)
        ref = self.ref
        for b in blocks:
            ref[b] = 1
        return blocks

    def take(self, n: int) -> list[int]:
        """``n`` blocks out of the free stack and the eviction order, unhashed, ref still 0:
        the caller gives them a reference or an index entry."""
        free = self.free_blocks
        k = len(free)
        if n <= k:
            blocks = free[k - n:]
            del free[k - n:]
            blocks.reverse()
        else:
            blocks = free[::-1]
            free.clear()
            blocks += self._evict(n - k, needed=n, free=k)
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block. NOTE: walks the table backwards, so a
        sequence's tail blocks are evicted before its head: the head is the prefix other
        requests are most likely to share."""
        ref, entry, free = self.ref, self.entry, self.free_blocks
        cached = []
        for b in reversed(blocks):
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                if entry[b] is None:
                    free.append(b)
                else:
                    cached.append(b)
        if cached:
            self.evictable.push(cached)

    def share(self, blocks: list[int], priority: int) -> None:
        """One more reference to each (cached) block; revives cached free blocks."""
        ref, evictable = self.ref, self.evictable
        revived = [b for b in blocks if ref[b] == 0]
        if revived:
            evictable.remove(revived)
        for b in blocks:
            ref[b] += 1
        evictable.touch(blocks, priority)

    def add_ref(self, blocks: list[int]) -> None:
        """One more reference to each in-use block (fork)."""
        ref = self.ref
        for b in blocks:
            ref[b] += 1

    # ---------------------------------------------------------- prefix index
    def evict(self, max_blocks: int | None = None) -> int:
        """Drop up to ``max_blocks`` (default all) cached free blocks from the index."""
        n = len(self.evictable) if max_blocks is None else min(max_blocks, len(self.evictable))
        victims = self._evict(n, reason=C.R_RESET)
        self.free_blocks.extend(reversed(victims))
        return n

    def drop(self, blocks: list[int], cause: dict[str, Any]) -> None:
        """Un-index these cached free blocks now (they become free), reporting ``cause``:
        a hybrid cache's window blocks whose group-0 twin was evicted."""
        entry, cached = self.entry, self.cached
        self.evictable.remove(blocks)
        for b in blocks:
            del cached[entry[b][0]]
            entry[b] = None
        self.free_blocks.extend(blocks)
        self.num_evictions += len(blocks)
        if self.sink.enabled:
            if self.group:
                self.sink.emit(S.EVICT, tier=self.tier, blocks=blocks, cause=cause,
                               group=self.group)
            else:  # the caller's cause, handed on (no one changes it later)
                self.sink.evict(self.tier, blocks, cause)

    def _evict(self, n: int, needed: int | None = None, free: int = 0,
               reason: str | None = None) -> list[int]:
        """Un-index the policy's next ``n`` victims; returns them in ascending id order
        (which blocks go is the policy's choice; ascending keeps slot runs contiguous)."""
        if n <= 0:
            return []
        entry, cached = self.entry, self.cached
        victims = self.evictable.pop(n)
        victims.sort()
        entries = [entry[b] for b in victims]
        for b, e in zip(victims, entries, strict=True):
            del cached[e[0]]
            entry[b] = None
        self.num_evictions += n
        if self.sink.enabled:
            cause: dict[str, Any] = {C.POLICY: self.evictable.name,  # a C.Cause map
                                     C.REASON: reason or self.reason, C.FREE_BLOCKS: free}
            if reason != C.R_RESET:
                cause[C.NEEDED_BY] = self.requester
                cause[C.BLOCKS_NEEDED] = needed if needed is not None else n
            if self.group:
                self.sink.emit(S.EVICT, tier=self.tier, blocks=victims, cause=cause,
                               group=self.group)
            else:  # the ids are copied: the caller may change victims
                self.sink.evict(self.tier, victims, cause)
        if self.writeback is not None:
            self.writeback(victims, entries)
        return victims
