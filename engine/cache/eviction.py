"""Eviction policies: which cached free block (ref 0, hashed) a pool reuses first.

A policy holds exactly the pool's cached free blocks and orders them; the pool asks it for
a victim only when no uncached free block is left (lazy eviction). Blocks in use (ref > 0)
are never in a policy, so they can never be evicted. Every policy is O(1) or O(log n) per
operation, including ``remove`` of a block from the middle, which is how a prefix hit
revives a cached free block.

Protocol (all block ids are the pool's ints; len, ``in`` and iteration see the queued
blocks):
    touch(blocks, priority)  blocks were stored or hit by a request of that priority
    push(blocks)             blocks became cached free, in order (first = evicted first
                             among equals)
    remove(blocks)           a prefix hit revived the blocks
    pop(n) -> blocks         the next n victims (n <= len); the policy forgets them
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator
from typing import Protocol

from kvscope.engine.cache.errors import CacheError


class EvictionPolicy(Protocol):
    name: str

    def __len__(self) -> int: ...

    def __contains__(self, block: int) -> bool: ...

    def __iter__(self) -> Iterator[int]: ...

    def touch(self, blocks: list[int], priority: int) -> None: ...

    def push(self, blocks: list[int]) -> None: ...

    def remove(self, blocks: list[int]) -> None: ...

    def pop(self, n: int) -> list[int]: ...


class LRUPolicy:
    """Least recently freed first. The queue is an OrderedDict, which CPython implements
    as a hash map plus a doubly linked list of its keys: append at the tail, unlink from the
    middle and pop the head are all O(1) (the same structure as vLLM's
    FreeKVCacheBlockQueue, without a Python-level node per block)."""

    name = "lru"

    def __init__(self) -> None:
        self._queue: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block: int) -> bool:
        return block in self._queue

    def __iter__(self) -> Iterator[int]:
        return iter(self._queue)

    def touch(self, blocks: list[int], priority: int) -> None:
        pass  # recency is the order of push; uses and priorities do not matter

    def push(self, blocks: list[int]) -> None:
        queue = self._queue
        for b in blocks:
            queue[b] = None

    def remove(self, blocks: list[int]) -> None:
        queue = self._queue
        for b in blocks:
            del queue[b]

    def pop(self, n: int) -> list[int]:
        popitem = self._queue.popitem
        return [popitem(last=False)[0] for _ in range(n)]


class LFUPolicy:
    """Least frequently used, with dynamic aging (LFU-DA): a block's score is the number of
    times it was stored or hit during its cached life plus the policy clock at the moment
    it became free; the clock rises to each victim's score, so a block that was popular
    long ago cannot outlive fresh blocks forever. Ties go to the least recently freed.

    NOTE: ``remove`` leaves a stale heap entry (recognised by its order stamp and skipped
    by ``pop``); the heap is rebuilt when stale entries outnumber live ones."""

    name = "lfu"

    def __init__(self) -> None:
        self._uses: dict[int, int] = {}  # block -> uses in its current cached life
        self._heap: list[tuple[int, int, int]] = []  # (score, stamp, block)
        self._live: dict[int, int] = {}  # queued block -> stamp of its live heap entry
        self._clock = 0
        self._stamp = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, block: int) -> bool:
        return block in self._live

    def __iter__(self) -> Iterator[int]:
        return iter(self._live)

    def touch(self, blocks: list[int], priority: int) -> None:
        uses = self._uses
        for b in blocks:
            uses[b] = uses.get(b, 0) + 1

    def push(self, blocks: list[int]) -> None:
        for b in blocks:
            self._stamp += 1
            self._live[b] = self._stamp
            heapq.heappush(self._heap, (self._clock + self._uses.get(b, 1), self._stamp, b))

    def remove(self, blocks: list[int]) -> None:
        for b in blocks:
            del self._live[b]
        if len(self._heap) > 2 * len(self._live) + 64:
            self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def pop(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            score, stamp, b = heapq.heappop(self._heap)
            if self._live.get(b) == stamp:
                del self._live[b]
                self._uses.pop(b, None)
                self._clock = score
                out.append(b)
        return out


class PriorityPolicy:
    """Retention priority, TensorRT-LLM style: a cached block keeps the highest priority of
    the requests that stored or hit it (larger = more important = kept longer); the lowest
    priority is evicted first, least recently freed first among equals."""

    name = "priority"

    def __init__(self) -> None:
        self._priority: dict[int, int] = {}  # block -> retention priority (cached life)
        self._levels: dict[int, OrderedDict[int, None]] = {}  # priority -> LRU queue
        self._level_of: dict[int, int] = {}  # queued block -> its priority level

    def __len__(self) -> int:
        return len(self._level_of)

    def __contains__(self, block: int) -> bool:
        return block in self._level_of

    def __iter__(self) -> Iterator[int]:
        return iter(self._level_of)

    def touch(self, blocks: list[int], priority: int) -> None:
        known = self._priority
        for b in blocks:
            if known.get(b, priority) <= priority:
                known[b] = priority

    def push(self, blocks: list[int]) -> None:
        for b in blocks:
            level = self._priority.get(b, 0)
            queue = self._levels.get(level)
            if queue is None:
                queue = self._levels[level] = OrderedDict()
            queue[b] = None
            self._level_of[b] = level

    def remove(self, blocks: list[int]) -> None:
        for b in blocks:
            level = self._level_of.pop(b)
            queue = self._levels[level]
            del queue[b]
            if not queue:
                del self._levels[level]

    def pop(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            level = min(self._levels)  # few distinct priorities: O(levels)
            queue = self._levels[level]
            while queue and len(out) < n:
                b = queue.popitem(last=False)[0]
                del self._level_of[b]
                self._priority.pop(b, None)
                out.append(b)
            if not queue:
                del self._levels[level]
        return out


POLICIES = {p.name: p for p in (LRUPolicy, LFUPolicy, PriorityPolicy)}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except (KeyError, TypeError):
        raise CacheError(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
