"""KVCacheManager: the bookkeeping of kvscope's paged KV cache (pure Python, no tensors).

The scheduler drives it; the runner turns what it returns (slot mappings, block tables,
copy orders) into tensor work. Every state change is reported to ``sink`` as the events of
``engine.events.schema`` (meaning: ``engine.events.state.KVState.apply``), so that a
KVState fed with them equals ``snapshot()`` after every engine step.

Shape: this class is the facade (the API below, the sequence table, status transitions
and their events, the prefix counters, the inline decode fast path) over helpers that
share the pools and receive ``CacheSeq`` records, never importing this module:
``CacheTiers`` (tiers.py: pools of every tier and group, swaps, eviction causes, disk
persistence), ``PrefixIndex`` (prefix_index.py: match, store of full blocks) and
``SlotAllocator`` (allocator.py: allocation, copy-on-write, fork, free).

The scheduler's flow, per sequence::

    add_sequence(sid, prompt_ids, priority=, cache_salt=)   # waiting, no blocks
    k = match_prefix(sid)            # admission: share cached blocks, k tokens computed
    if can_allocate(sid, n, watermark):                      # n = prompt tokens - k
        slots = allocate_slots(sid, n)                       # or None: nothing changed
        start(sid)                   # (resume(sid) after a preemption)
    else:
        free(sid)                    # undo the shared prefix; stays waiting
    ... each decode step: allocate_slots(sid, 1) -> [slot] for the token fed this step,
        then, after sampling, append_token_ids(sid, [new_id])
    preempt(sid)                     # recompute: blocks freed, back to waiting; token ids
                                     # kept, so match_prefix can re-share them later
    preempt(sid, "swap")             # -> "swap": table moved to the cpu tier, status
                                     # swapped; -> "recompute" when the host is too full
    if can_swap_in(sid, n, watermark):
        swap_in(sid)                 # table back on the gpu, running; then allocate_slots
    finish(sid, "stop")              # frees and forgets the sequence
    ... end of every step: take_swap_rounds() and take_copy_orders() for the runner (in
        that order), flush_step_events()

Rules:
- Blocks are allocated on demand, never reserved: a sequence holds
  ceil(num_tokens / block_size) blocks, so waste is at most its last block's tail.
- A slot is ``block_id * block_size + offset``; ``allocate_slots`` returns one per new
  token position, in order. ``allocate_slots(sid, 1)`` into a private, partly filled
  last block (the common decode case) is O(1) and allocates no block: a counter bump and
  a block-boundary check.
- Prefix caching: a block is indexed (``store``) as soon as it is full of slots AND all its
  token ids are known: inside ``allocate_slots`` for prompt and decode tokens (their ids
  are known before their slots), inside ``append_token_ids`` when slots were allocated
  ahead of the ids (lookahead). A hit is verified by exact token and parent comparison:
  a hash collision is a miss, never a wrong hit (prefix_index, engine.cache.hashing).
- ``match_prefix`` shares at most ``len(token_ids) - 1`` tokens: the last token is always
  computed, because its logits are needed. Hits and queries are counted in tokens, once
  per ``match_prefix`` call (a request retried after ``free`` is counted again).
- Copy-on-write: appending into a partial last block that another sequence also holds
  (after ``fork``) first moves this sequence onto a private copy (event ``cow``) and queues
  (src, dst) for the runner, which must copy before the step's forward pass.
- Eviction is lazy (a cached block is evicted only when an allocation takes it), in the
  order of the swappable policy ("lru", "lfu", "priority"); blocks with ref > 0 are never
  evicted. ``priority``: larger = more important (kept longer by the "priority" policy).
- Every bad call raises CacheError before changing anything.
- The "cpu" tier exists when ``num_cpu_blocks > 0`` (engine.cache.host_tier): swap space
  for ``preempt(mode="swap")`` and, with prefix caching, a write-back host prefix cache
  that ``match_prefix`` continues into (``host_hit``). A swapped sequence's table holds
  host block ids; it can only be finished or swapped in. Beside a window group the cpu
  tier is swap space only, a host pool per group (engine.cache.window_group);
  ``take_window_swap_rounds`` carries group 1's copies.
- The "disk" tier exists when ``num_disk_blocks > 0`` (it needs the cpu tier and prefix
  caching; engine.cache.disk_tier): hashed host blocks that the host evicts are written
  to disk; ``prefetch(sid)`` starts reading a waiting sequence's prefix from disk into the
  host (True while reads are in flight: the scheduler waits, a bounded time, then calls
  ``give_up_prefetch``); the runner's outcomes come back through ``disk_results``.
- Block copies between tiers are queued as swap orders with a sequential meaning; the
  runner executes ``take_swap_rounds()`` (batched, engine.cache.transfers) before the
  step's copy-on-write orders and forward pass.

Events: the constructor emits ``tier_init`` per tier; ``add_sequence``/``fork`` emit
``seq_add`` (``fork`` also ``fork``, and ``seq_start`` when the parent runs);
``match_prefix`` ``hit``; ``allocate_slots`` ``evict`` (lazy eviction), ``cow``, ``alloc``,
``store``; ``append_token_ids`` ``store`` (lookahead only); ``free``/``preempt``/``finish``
``free`` then ``seq_preempt``/``seq_finish``; ``start``/``resume`` ``seq_start``/
``seq_resume``; ``evict_cached`` ``evict``; ``preempt(mode="swap")`` ``offload`` (the
host copies that get indexed) then ``swap_out`` and ``seq_preempt``; ``swap_in``
``swap_in``, ``store`` (gpu) and ``seq_resume``; any gpu eviction with a host tier
``evict`` then ``offload``, and a host eviction ``evict`` (tier cpu); ``match_prefix``
``hit``/``host_hit`` in table order. Token counts are not an event per token:
``flush_step_events`` emits one ``seq_tokens`` for the sequences whose count changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from kvscope.engine.cache import report
from kvscope.engine.cache.allocator import SlotAllocator
from kvscope.engine.cache.block_pool import BlockPool
from kvscope.engine.cache.demotion import DemotionPolicy, merge_orders, plan_demotion
from kvscope.engine.cache.disk_tier import DiskTier
from kvscope.engine.cache.errors import CacheError
from kvscope.engine.cache.hashing import root_hash
from kvscope.engine.cache.host_tier import HostTier
from kvscope.engine.cache.prefix_index import PrefixIndex
from kvscope.engine.cache.sequence import CacheSeq
from kvscope.engine.cache.spec import KVSpec
from kvscope.engine.cache.tiers import CacheTiers, check_config
from kvscope.engine.cache.transfers import Round
from kvscope.engine.cache.validation import (
    check_count,
    check_new_id,
    check_watermark,
    is_int,
    token_list,
)
from kvscope.engine.cache.window_group import WindowGroup
from kvscope.engine.events import causes as C
from kvscope.engine.events import schema as S
from kvscope.engine.events.sink import EventSink, NullSink


class KVCacheManager:
    def __init__(
        self,
        num_gpu_blocks: int | None = None,
        block_size: int | None = None,
        *,
        spec: KVSpec | None = None,
        num_cpu_blocks: int = 0,
        num_disk_blocks: int = 0,
        enable_prefix_caching: bool = True,
        eviction_policy: str = "lru",
        kv_format: str = "auto",
        sink: EventSink | None = None,
        demotion: DemotionPolicy | None = None,
        window: int | None = None,
        num_window_blocks: int = 0,
        num_window_cpu_blocks: int = 0,
    ) -> None:
        # ``spec``: the engine's whole layout (engine.cache.spec), in place of the sizes,
        # window and format one by one (which tests and tools still give)
        if spec is not None:
            if num_gpu_blocks is not None or block_size is not None or num_cpu_blocks or \
                    num_disk_blocks or window is not None or num_window_blocks or \
                    num_window_cpu_blocks or kv_format != "auto":
                raise CacheError("give a KVSpec or the sizes one by one, not both")
            num_gpu_blocks, block_size = spec.num_blocks, spec.block_size
            num_cpu_blocks, num_disk_blocks = spec.num_cpu_blocks, spec.num_disk_blocks
            window, num_window_blocks = spec.window, spec.num_window_blocks
            num_window_cpu_blocks, kv_format = spec.num_window_cpu_blocks, spec.format
        check_config(num_gpu_blocks, block_size, num_cpu_blocks, num_disk_blocks,
                     enable_prefix_caching, kv_format, demotion, window, num_window_blocks,
                     num_window_cpu_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.eviction_policy = eviction_policy
        self.demotion = demotion
        self._sink: EventSink = sink if sink is not None else NullSink()
        tiers = self._tiers = CacheTiers(
            num_gpu_blocks, block_size, num_cpu_blocks=num_cpu_blocks,
            num_disk_blocks=num_disk_blocks, enable_prefix_caching=self.enable_prefix_caching,
            eviction_policy=eviction_policy, kv_format=kv_format, sink=self._sink,
            demotion=demotion, window=window, num_window_blocks=num_window_blocks,
            num_window_cpu_blocks=num_window_cpu_blocks)
        self.pools: dict[str, BlockPool] = tiers.pools
        self.gpu = tiers.gpu
        self._ref = self.gpu.ref  # the decode fast path reads it directly
        self.host: HostTier | None = tiers.host
        self.disk: DiskTier | None = tiers.disk
        self.window: WindowGroup | None = tiers.window
        self.window_host: HostTier | None = tiers.window_host
        self._index = PrefixIndex(tiers, self._sink)
        self._alloc = SlotAllocator(tiers, self._index, self._sink, self.enable_prefix_caching)
        self._store = self._index.store  # bound once: the decode fast path calls it
        self._seqs: dict[str, CacheSeq] = {}
        # the sequences whose num_tokens moved since the last flush_step_events, noted
        # while the sink is enabled (every write of num_tokens but drop_table's, which
        # resets reported_tokens with it): the flush visits these, not every sequence
        self._moved: dict[str, CacheSeq] = {}
        self._demotion_orders: list[tuple[int, int]] = []
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_preemptions = 0
        self.num_swap_fallbacks = 0  # swap preemptions done as recompute: host too full

    @property
    def sink(self) -> EventSink:
        """Where the events go. Setting it re-points the manager and its helpers (the
        pools and tiers keep the sink they were built with, as before the split)."""
        return self._sink

    @sink.setter
    def sink(self, sink: EventSink) -> None:
        self._sink = self._index.sink = self._alloc.sink = sink

    @property
    def num_cow_copies(self) -> int:
        return self._alloc.num_cow_copies

    # ------------------------------------------------------------ sequences
    def add_sequence(
        self, seq_id: str, prompt_token_ids: Any, *, priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """A new waiting sequence with no blocks. ``prompt_token_ids``: a non-empty
        sequence of non-negative ints (list, tuple or numpy array)."""
        check_new_id(self._seqs, seq_id)
        if not is_int(priority):
            raise CacheError(f"priority must be an int, got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise CacheError(f"cache_salt must be a str or None, got {cache_salt!r}")
        ids = token_list(prompt_token_ids, copy=True)
        if not ids:
            raise CacheError(f"{seq_id!r}: the prompt is empty")
        seq = CacheSeq(seq_id, ids, priority, cache_salt, root_hash(cache_salt))
        self._seqs[seq_id] = seq
        if self._sink.enabled:
            self._sink.seq_add(seq_id, len(ids), priority)

    def append_token_ids(self, seq_id: str, token_ids: Any) -> None:
        """Record generated token ids (they get their slots from ``allocate_slots``)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            self._get(seq_id)  # raises
        toks = seq.token_ids
        known = len(toks)
        if type(token_ids) is list and len(token_ids) == 1:  # decode: inline the checks
            t = token_ids[0]
            if type(t) is int and t >= 0:
                toks.append(t)
            else:
                token_list(token_ids, copy=False)  # raises
        else:
            toks += token_list(token_ids, copy=False)
        # Only lookahead slots can be waiting for ids to complete a block.
        if seq.num_tokens > known and self.enable_prefix_caching:
            self._store(seq)

    def fork(self, parent_id: str, child_id: str) -> None:
        """``child_id`` shares every block of ``parent_id`` (ref + 1) and copies its token
        ids and status; the first append to a still-shared partial block copies it.
        NOTE: blocks holding slots of not yet known tokens (lookahead, or a whole reserved
        context) are not shared: both sequences would write their own tokens there. The
        child gets private blocks for them at once (event ``cow``; a copy order only for
        the block whose first positions are already computed), or, when the pool has too
        few blocks, the fork raises CacheError and nothing changes."""
        parent = self._get(parent_id)
        if parent.tier != "gpu":
            raise CacheError(f"cannot fork {parent_id!r}: it is swapped out")
        check_new_id(self._seqs, child_id)
        child = self._seqs[child_id] = self._alloc.fork(parent, child_id)
        if child.num_tokens != child.reported_tokens and self._sink.enabled:
            self._moved[child_id] = child

    def start(self, seq_id: str) -> None:
        """First schedule: waiting -> running."""
        seq = self._get(seq_id)
        if seq.started or seq.status != "waiting":
            raise CacheError(f"{seq_id!r} has already started (status {seq.status})")
        seq.status, seq.started = "running", True
        if self._sink.enabled:
            self._sink.seq_start(seq_id)

    def preempt(self, seq_id: str, mode: str = "recompute",
                cause: dict[str, Any] | None = None) -> str:
        """Take a running sequence off the gpu; returns the mode used.

        "recompute": running -> waiting, all blocks freed (its token ids are kept, so it
        recomputes, re-sharing what is still cached). "swap": running -> swapped, its table
        moved to the cpu tier (its gpu blocks are released, so hashed ones stay cached
        there until evicted); when the host pool cannot take it, it is preempted by
        recompute instead (counted in ``num_swap_fallbacks``). ``cause`` (the scheduler's
        reason, engine.events.causes) travels in the ``seq_preempt`` event."""
        seq = self._get(seq_id)
        if mode not in S.PREEMPT_MODES:
            raise CacheError(f"unknown preemption mode {mode!r}; one of {S.PREEMPT_MODES}")
        if mode == "swap" and self.host is None:
            raise CacheError("swap preemption needs a cpu tier (num_cpu_blocks > 0)")
        if seq.status != "running":
            raise CacheError(f"cannot preempt {seq_id!r}: it is {seq.status}")
        self.num_preemptions += 1
        extra = {} if cause is None else {"cause": cause}
        if mode == "swap":
            self._tiers.asking(seq_id, C.R_SWAP_OUT)
            if self._tiers.swap_out(seq):
                seq.status = "swapped"
                if self._sink.enabled:
                    self._sink.emit(S.SEQ_PREEMPT, seq=seq_id, mode="swap", **extra)
                return "swap"
            self.num_swap_fallbacks += 1
            if cause is not None:
                extra = {"cause": {**cause, C.FALLBACK: "swap fell back to recompute: "
                                   "the host pool was full"}}
        self._alloc.free(seq)
        seq.status = "waiting"
        if self._sink.enabled:
            self._sink.emit(S.SEQ_PREEMPT, seq=seq_id, mode="recompute", **extra)
        return "recompute"

    def can_swap_in(self, seq_id: str, num_new_tokens: int = 0,
                    watermark: float = 0.0) -> bool:
        """Whether ``swap_in(seq_id)`` followed by ``allocate_slots(seq_id,
        num_new_tokens)`` would succeed and leave ``watermark * num_gpu_blocks`` blocks."""
        seq = self._swapped(seq_id)
        check_count(num_new_tokens)
        check_watermark(watermark)
        return self._tiers.swap_in_fits(seq, num_new_tokens, watermark)

    def swap_in(self, seq_id: str) -> bool:
        """Swapped -> running: the table moves back to gpu blocks (shared where the gpu
        still indexes the same content). False, with nothing changed, when the gpu pool is
        too full."""
        seq = self._swapped(seq_id)
        self._tiers.asking(seq_id, C.R_SWAP_IN)
        if not self._tiers.swap_in(seq):
            return False
        seq.status = "running"
        if self.enable_prefix_caching:
            self._store(seq)  # blocks whose ids arrived while swapped out
        if self._sink.enabled:
            self._sink.emit(S.SEQ_RESUME, seq=seq_id)
        return True

    def _swapped(self, seq_id: str) -> CacheSeq:
        seq = self._get(seq_id)
        if seq.status != "swapped":
            raise CacheError(f"{seq_id!r} is not swapped out (status {seq.status})")
        return seq

    def resume(self, seq_id: str) -> None:
        """A preempted sequence runs again (allocate its blocks first)."""
        seq = self._get(seq_id)
        if not seq.started or seq.status != "waiting":
            raise CacheError(f"{seq_id!r} was not preempted by recompute (status "
                             f"{seq.status}; a swapped sequence resumes with swap_in)")
        seq.status = "running"
        if self._sink.enabled:
            self._sink.emit(S.SEQ_RESUME, seq=seq_id)

    def free(self, seq_id: str) -> None:
        """Drop the sequence's blocks; it stays known (status unchanged). A swapped
        sequence cannot be freed (it would be swapped with nothing): finish it instead."""
        seq = self._get(seq_id)
        if seq.status == "swapped":
            raise CacheError(f"{seq_id!r} is swapped out: finish it or swap it in")
        self._alloc.free(seq)

    def finish(self, seq_id: str, reason: str) -> None:
        """Free the sequence's blocks and forget it."""
        seq = self._get(seq_id)
        if reason not in S.FINISH_REASONS:
            raise CacheError(f"unknown finish reason {reason!r}; one of {S.FINISH_REASONS}")
        num_tokens = seq.num_tokens  # its last step's tokens: no seq_tokens will say it
        self._alloc.free(seq)
        if self.disk is not None:
            self.disk.give_up(seq_id, timed_out=False)
        del self._seqs[seq_id]
        if self._sink.enabled:
            self._sink.seq_finish(seq_id, reason, num_tokens,
                                  len(seq.token_ids) - seq.num_prompt_tokens)

    # --------------------------------------------------------- prefix cache
    def match_prefix(self, seq_id: str) -> int:
        """Share the longest verified cached prefix of the sequence's token ids (up to all
        but the last token); return the number of computed tokens. Call it while the
        sequence holds no blocks (admission, or re-admission after a preemption). With a
        cpu tier the prefix may continue in the host index: those blocks are loaded into
        fresh gpu blocks (as many as the gpu pool can take)."""
        seq = self._get(seq_id)
        if seq.block_table:
            raise CacheError(f"{seq_id!r} already holds blocks; free it before matching")
        if seq.status == "swapped":
            raise CacheError(f"{seq_id!r} is swapped out: swap it in instead")
        if not self.enable_prefix_caching:
            return 0
        num_hit = self._index.match(seq)
        self.num_query_tokens += len(seq.token_ids)
        self.num_hit_tokens += num_hit
        if num_hit and self._sink.enabled:
            self._moved[seq_id] = seq
        return num_hit

    def prefetch(self, seq_id: str) -> bool:
        """Start reading from disk the blocks that continue the waiting sequence's cached
        prefix (its first call does; engine.cache.disk_tier). True while its reads are in
        flight: scheduled now, it would recompute them. False without a disk tier."""
        seq = self._get(seq_id)
        if self.disk is None or seq.block_table or seq.status == "swapped":
            return False
        return self.disk.prefetch(seq, self.block_size)

    def give_up_prefetch(self, seq_id: str) -> None:
        """The sequence waited long enough: it stops waiting for its reads (counted)."""
        if self.disk is not None:
            self.disk.give_up(seq_id)

    def disk_results(self, saved: list[tuple[int, int, bool]],
                     loaded: list[tuple[int, bool]], disabled: bool = False) -> None:
        """The runner's disk outcomes since the last call: writes (disk block, hash,
        written?), reads (disk block, intact?) in the order they were started, and
        whether the store has failed for good (the tier then forgets its blocks)."""
        if self.disk is not None:
            self._tiers.disk_results(saved, loaded, disabled)

    def persist_to_disk(self) -> int:
        """A graceful stop: every cached gpu block is written back to the host, and every
        host-cached block the disk lacks is written to disk (bounded by the disk's size);
        returns the blocks queued for disk. The runner then performs the rounds and waits
        for the writes, bounded by its drain time."""
        return self._tiers.persist_to_disk() if self.disk is not None else 0

    def adopt_disk(self, found: list[tuple[int, int, bool, tuple[int, ...]]]) -> int:
        """Index the blocks a warm disk directory holds, (hash, parent hash, first?,
        tokens), oldest first; returns how many fit (engine.cache.disk_tier.adopt)."""
        return self.disk.adopt(found) if self.disk is not None else 0

    def evict_cached(self, max_blocks: int | None = None) -> int:
        """Evict up to ``max_blocks`` (default: all) cached free blocks now, in policy
        order; returns how many. (Allocation evicts lazily; this is a prefix-cache reset.)"""
        if max_blocks is not None and (not is_int(max_blocks) or max_blocks < 0):
            raise CacheError(f"max_blocks must be an int >= 0, got {max_blocks!r}")
        return self._tiers.evict_cached(max_blocks)

    # ------------------------------------------------------------ allocation
    def can_allocate(self, seq_id: str, num_new_tokens: int, watermark: float = 0.0) -> bool:
        """Whether ``allocate_slots(seq_id, num_new_tokens)`` would succeed and still leave
        ``watermark * num_gpu_blocks`` blocks (free or evictable) for running sequences."""
        seq = self._get(seq_id)
        check_count(num_new_tokens)
        check_watermark(watermark)
        if seq.tier != "gpu":
            raise CacheError(f"{seq_id!r} is swapped out: use can_swap_in")
        return self._alloc.fits(seq, num_new_tokens, watermark)

    def allocate_slots(self, seq_id: str, num_new_tokens: int) -> list[int] | None:
        """Slots for the next ``num_new_tokens`` token positions of the sequence, allocating
        (and copying-on-write) blocks as needed; None, with nothing changed, when the pool
        has too few blocks."""
        seq = self._seqs.get(seq_id)
        if seq is not None and num_new_tokens == 1:
            # Decode fast path (inline, not in the allocator: it runs once per token): one
            # more slot in a private, partly filled last block.
            n = seq.num_tokens
            bs = self.block_size
            off = n % bs
            if off and seq.tier == "gpu":
                last = seq.block_table[-1]
                if self._ref[last] == 1:
                    if self.window is not None:  # release what left the window
                        out = self.window.release_before(seq, n)
                        if out and self._sink.enabled:
                            self._sink.emit(S.RELEASE, tier="gpu", seq=seq_id, group=1,
                                            blocks=out)
                    seq.num_tokens = n + 1
                    if self._sink.enabled:
                        self._moved[seq_id] = seq
                    if off + 1 == bs and self.enable_prefix_caching:
                        self._store(seq)
                    return [last * bs + off]
        if seq is None:
            self._get(seq_id)  # raises
        check_count(num_new_tokens)
        if seq.tier != "gpu":
            raise CacheError(f"{seq_id!r} is swapped out: swap it in before allocating")
        slots = self._alloc.allocate(seq, num_new_tokens)
        if slots and self._sink.enabled:  # non-empty: num_tokens moved
            self._moved[seq_id] = seq
        return slots

    def blocks_needed(self, seq_id: str, num_new_tokens: int) -> int:
        """GPU blocks ``allocate_slots(seq_id, num_new_tokens)`` would take."""
        return self._alloc.blocks_needed(self._get(seq_id), num_new_tokens)

    def window_slots(self, seq_id: str, start: int, end: int) -> list[int]:
        """Window-group slots of positions [start, end) of the sequence (allocated)."""
        return self.window.slots(self._get(seq_id), start, end)

    def window_table(self, seq_id: str) -> list[int]:
        """The window group's table as the kernels read it (released entries: block 0)."""
        return self.window.runner_table(self._get(seq_id))

    def take_window_copy_orders(self) -> list[tuple[int, int]]:
        """The window group's copy-on-write (src, dst) block copies since the last call."""
        if self.window is None:
            return []
        out, self.window.copy_orders = self.window.copy_orders, []
        return out

    def take_swap_rounds(self) -> list[Round]:
        """The block copies between tiers queued since the last call, batched into rounds
        of (gpu->cpu pairs, cpu->gpu pairs) (engine.cache.transfers). The runner performs
        them in order, each round's first list before its second, before the step's
        copy-on-write orders and forward pass."""
        return self._tiers.take_swap_rounds()

    def take_window_swap_rounds(self) -> list[Round]:
        """``take_swap_rounds`` of the window group (group 1): copies between its gpu pool
        and its host pool, which address the windowed layers' pages. Independent of group
        0's rounds (disjoint blocks and pages), so either may run first."""
        return self._tiers.take_window_swap_rounds()

    def demote_cold_blocks(self, reserve: int = 0) -> int:
        """With demotion on and free frames under the policy's watermark (or under
        ``reserve``, the frames the next admission needs): demote the coldest full blocks
        (engine.cache.demotion) and queue their (old, new) page codes for the runner;
        returns how many. Call between steps (every block in a table then holds
        computed K/V), before ``schedule``; the runner executes the orders before the
        step's copy-on-write orders and forward pass."""
        if self.demotion is None:
            return 0
        orders = plan_demotion(self, reserve)  # (old, new) per move, in order
        self._demotion_orders += orders
        return len(orders)

    def take_demotion_orders(self) -> list[tuple[int, int]]:
        """(source page code, destination page code) per block demoted since the last call,
        for ONE batched gather-then-scatter (engine.cache.demotion.merge_orders)."""
        out, self._demotion_orders = merge_orders(self._demotion_orders), []
        return out

    def page_codes(self, table: list[int]) -> list[int]:
        """The kernels' page codes of a block table (mixed pools only)."""
        code = self.gpu.page_code
        return [code(b) for b in table]

    def take_copy_orders(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies queued by copy-on-write since the last call. The
        runner performs them before the step's forward pass."""
        return self._alloc.take_copy_orders()

    # ---------------------------------------------------------------- reading
    def block_table(self, seq_id: str) -> list[int]:
        return list(self._get(seq_id).block_table)

    def num_tokens(self, seq_id: str) -> int:
        """Token positions of the sequence that hold a slot (the mirror's num_tokens)."""
        return self._get(seq_id).num_tokens

    def token_ids(self, seq_id: str) -> list[int]:
        return list(self._get(seq_id).token_ids)

    def status(self, seq_id: str) -> str:
        return self._get(seq_id).status

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    @property
    def sequences(self) -> Mapping[str, CacheSeq]:
        """Every known sequence by id, read-only (``engine.cache.view.CacheView``)."""
        return MappingProxyType(self._seqs)

    @property
    def num_swapped(self) -> int:
        return sum(1 for s in self._seqs.values() if s.status == "swapped")

    @property
    def num_free_blocks(self) -> int:
        """GPU blocks an allocation can take (free + cached free)."""
        return self.gpu.num_free_blocks

    def flush_step_events(self) -> None:
        """Emit one ``seq_tokens`` for the sequences whose token count changed since the
        last call (the engine calls this at the end of every step), in the order they
        first moved. Only moves made while the sink is enabled are seen (``_moved``): a
        sink attached to a running manager starts from a snapshot, and a sequence moved
        before it is reported with its next move."""
        moved = self._moved
        if not moved or not self._sink.enabled:
            return
        self._moved = {}
        seqs, counts, live = [], [], self._seqs
        for sid, seq in moved.items():
            n = seq.num_tokens
            if n != seq.reported_tokens and live.get(sid) is seq:  # still here
                seq.reported_tokens = n
                seqs.append(sid)
                counts.append(n)
        if seqs:
            self._sink.seq_tokens(seqs, counts)  # both handed over

    def snapshot(self) -> dict[str, Any]:
        """The state in exactly the form of ``KVState.canonical()``."""
        return report.snapshot(self)

    def metrics(self) -> dict[str, Any]:
        """Counts per tier, usage by blocks and by tokens, prefix hits, evictions, copies
        (see report.py). ``tiers`` has the shape of the step stats' "tiers" map."""
        return report.metrics(self)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (see invariants.py)."""
        from kvscope.engine.cache.invariants import check_invariants

        check_invariants(self)

    def _get(self, seq_id: str) -> CacheSeq:
        seq = self._seqs.get(seq_id) if isinstance(seq_id, str) else None
        if seq is None:
            raise CacheError(f"unknown sequence {seq_id!r} (never added, or already finished)")
        return seq
