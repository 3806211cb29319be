"""KVCacheManager: the bookkeeping of kvscope's paged KV cache (pure Python, no tensors).

The scheduler drives it; the runner turns what it returns (slot mappings, block tables,
copy orders) into tensor work. Every state change is reported to ``sink`` as the events of
``engine.events.schema`` (meaning: ``engine.events.state.KVState.apply``), so that a
KVState fed with them equals ``snapshot()`` after every engine step.

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
  ahead of the ids (lookahead). Hashes are chained CPython tuple hashes, deterministic
  across processes; a hit is verified by exact token and parent comparison, so a hash
  collision is a miss, never a wrong hit (engine.cache.hashing explains the choice).
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
  for ``preempt(mode="swap")``, and, with prefix caching, a write-back host prefix cache:
  an evicted cached gpu block is copied to the host, and ``match_prefix`` continues past
  the gpu index into the host index, loading those blocks back (``host_hit``). A swapped
  sequence's table holds host block ids; it can only be finished or swapped in. Beside a
  window group (``window``) the cpu tier is swap space only, with a host pool per group
  (``num_window_cpu_blocks`` for group 1: engine.cache.window_group); swap events name
  the group and ``take_window_swap_rounds`` carries group 1's copies.
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
from itertools import islice
from types import MappingProxyType
from typing import Any

from kvscope.engine.cache import report
from kvscope.engine.cache.block_pool import BlockPool
from kvscope.engine.cache.demotion import DemotionPolicy, plan_demotion
from kvscope.engine.cache.disk_tier import DiskTier
from kvscope.engine.cache.errors import CacheError
from kvscope.engine.cache.eviction import make_policy
from kvscope.engine.cache.hashing import root_hash
from kvscope.engine.cache.host_tier import HostTier
from kvscope.engine.cache.mixed_pool import MixedBlockPool
from kvscope.engine.cache.sequence import CacheSeq
from kvscope.engine.cache.slots import slot_mapping
from kvscope.engine.cache.spec import KVSpec
from kvscope.engine.cache.transfers import Round, plan_rounds
from kvscope.engine.cache.validation import check_count, is_int, token_list
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
        if not is_int(block_size) or block_size < 1:
            raise CacheError(f"block_size must be a positive int, got {block_size!r}")
        if not is_int(num_gpu_blocks) or num_gpu_blocks < 1:
            raise CacheError(f"the gpu pool needs at least one block, got {num_gpu_blocks!r}")
        if not is_int(num_cpu_blocks) or num_cpu_blocks < 0:
            raise CacheError(f"num_cpu_blocks must be an int >= 0, got {num_cpu_blocks!r}")
        if not is_int(num_disk_blocks) or num_disk_blocks < 0:
            raise CacheError(f"num_disk_blocks must be an int >= 0, got {num_disk_blocks!r}")
        if num_disk_blocks and not (num_cpu_blocks and enable_prefix_caching):
            raise CacheError("the disk tier needs a cpu tier (num_cpu_blocks > 0) and prefix "
                             "caching: it stores the host's evicted prefix-cache blocks")
        if kv_format not in S.KV_FORMATS:
            raise CacheError(f"unknown kv_format {kv_format!r}; choose one of {S.KV_FORMATS}")
        if window is not None:
            if not is_int(window) or window < 1:
                raise CacheError(f"window must be a positive int, got {window!r}")
            if not is_int(num_window_blocks) or num_window_blocks < 1:
                raise CacheError("a window group needs at least one block, got "
                                 f"{num_window_blocks!r}")
            if demotion is not None:
                raise CacheError("a sliding-window group cannot be combined with kv demotion "
                                 "yet: the window pool has no mixed-format frames")
            if num_disk_blocks:
                raise CacheError("a sliding-window group cannot be combined with a disk tier "
                                 "yet: its cpu tier is swap space only, no host prefix cache "
                                 "(a host hit would need the window blocks of its last W "
                                 "tokens on the host too)")
            if not is_int(num_window_cpu_blocks) or num_window_cpu_blocks < 0 or \
                    bool(num_cpu_blocks) != bool(num_window_cpu_blocks):
                raise CacheError("a cpu tier beside a window group needs both host pools "
                                 "(num_cpu_blocks and num_window_cpu_blocks > 0), or neither; "
                                 f"got {num_cpu_blocks!r} and {num_window_cpu_blocks!r}")
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.eviction_policy = eviction_policy
        self.sink: EventSink = sink if sink is not None else NullSink()
        self.pools: dict[str, BlockPool] = {}
        sizes = {"gpu": num_gpu_blocks, "cpu": num_cpu_blocks, "disk": num_disk_blocks}
        self.demotion = demotion
        if demotion is not None:
            if num_cpu_blocks:
                raise CacheError("kv demotion and a cpu tier cannot be combined yet: swapped "
                                 "and offloaded blocks would need per-block formats on the host")
            self.pools["gpu"] = MixedBlockPool(
                "gpu", num_gpu_blocks, demotion.subs, block_size, kv_format,
                make_policy(eviction_policy), self.sink)
        for tier in S.TIERS:
            if sizes[tier] and tier not in self.pools:
                self.pools[tier] = BlockPool(
                    tier, sizes[tier], block_size, kv_format,
                    make_policy("lru" if tier == "disk" else eviction_policy), self.sink,
                )
        self.gpu = self.pools["gpu"]
        self._ref = self.gpu.ref  # the decode fast path reads it directly
        self.host: HostTier | None = None
        if "cpu" in self.pools:  # beside a window group: swap space only (window_group)
            self.host = HostTier(self.gpu, self.pools["cpu"], self.sink,
                                 write_back=self.enable_prefix_caching and window is None)
        self.disk: DiskTier | None = None
        if "disk" in self.pools:
            self.disk = DiskTier(self.gpu, self.host, self.pools["disk"], self.sink)
        # group 1, the sliding-window layers' blocks (engine.cache.window_group), or None
        self.window: WindowGroup | None = None
        self.window_host: HostTier | None = None  # group 1's swaps (its own host pool)
        if window is not None:  # its evictions name group 1 (BlockPool.group)
            pools = [BlockPool(tier, n, block_size, kv_format, make_policy("lru"), self.sink)
                     for tier, n in (("gpu", num_window_blocks), ("cpu", num_window_cpu_blocks))
                     if n]
            for pool in pools:
                pool.group = 1
            self.window = WindowGroup(pools[0], window, pools[1] if len(pools) > 1 else None)
            if self.window.host is not None:
                self.window_host = HostTier(self.window.pool, self.window.host, self.sink,
                                            write_back=False)
            # the host tier does not write back beside a window group: the hook is free
            self.gpu.writeback = self._drop_window_twins
        self._seqs: dict[str, CacheSeq] = {}
        # the sequences whose num_tokens moved since the last flush_step_events, noted
        # while the sink is enabled (every write of num_tokens but drop_table's, which
        # resets reported_tokens with it): the flush visits these, not every sequence
        self._moved: dict[str, CacheSeq] = {}
        self._copy_orders: list[tuple[int, int]] = []
        self._demotion_orders: list[tuple[int, int]] = []
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_cow_copies = 0
        self.num_preemptions = 0
        self.num_swap_fallbacks = 0  # swap preemptions done as recompute: host too full
        if self.sink.enabled:
            for pool in self.pools.values():
                self.sink.emit(
                    S.TIER_INIT, tier=pool.tier, num_blocks=pool.num_blocks,
                    block_size=block_size, format=kv_format,
                )
            if self.window is not None:
                self.sink.emit(S.TIER_INIT, tier="gpu", num_blocks=num_window_blocks,
                               block_size=block_size, format=kv_format, group=1)
            if self.window_host is not None:
                self.sink.emit(S.TIER_INIT, tier="cpu", num_blocks=num_window_cpu_blocks,
                               block_size=block_size, format=kv_format, group=1)

    # ------------------------------------------------------------ sequences
    def add_sequence(
        self, seq_id: str, prompt_token_ids: Any, *, priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """A new waiting sequence with no blocks. ``prompt_token_ids``: a non-empty
        sequence of non-negative ints (list, tuple or numpy array)."""
        if not isinstance(seq_id, str):
            raise CacheError(f"sequence ids are str, got {seq_id!r}")
        if seq_id in self._seqs:
            raise CacheError(f"duplicate sequence id {seq_id!r}")
        if not is_int(priority):
            raise CacheError(f"priority must be an int, got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise CacheError(f"cache_salt must be a str or None, got {cache_salt!r}")
        ids = token_list(prompt_token_ids, copy=True)
        if not ids:
            raise CacheError(f"{seq_id!r}: the prompt is empty")
        seq = CacheSeq(seq_id, ids, priority, cache_salt, root_hash(cache_salt))
        self._seqs[seq_id] = seq
        if self.sink.enabled:
            self.sink.seq_add(seq_id, len(ids), priority)

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
            self._store_full_blocks(seq)

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
        if not isinstance(child_id, str):
            raise CacheError(f"sequence ids are str, got {child_id!r}")
        if child_id in self._seqs:
            raise CacheError(f"duplicate sequence id {child_id!r}")
        bs, table, known = self.block_size, parent.block_table, len(parent.token_ids)
        first_private = known // bs if parent.num_tokens > known else len(table)
        num_private = len(table) - first_private
        if num_private and self.window is not None:
            raise CacheError(f"cannot fork {parent_id!r}: its lookahead slots would need "
                             "private window-group copies (not supported yet)")
        self._asking(child_id, C.R_FORK)
        if num_private > self.gpu.num_free_blocks:
            raise CacheError(f"cannot fork {parent_id!r}: its {num_private} blocks of "
                             "lookahead slots need private copies and the pool is short")
        child = CacheSeq(
            child_id, list(parent.token_ids), parent.priority, parent.cache_salt,
            parent.root_hash,
        )
        child.num_prompt_tokens = parent.num_prompt_tokens
        child.block_table = list(table)
        child.num_tokens = parent.num_tokens
        child.reported_tokens = parent.reported_tokens  # what the mirror's fork copies
        if child.num_tokens != child.reported_tokens and self.sink.enabled:
            self._moved[child_id] = child
        child.chain_hash, child.chain_id = parent.chain_hash, parent.chain_id
        child.num_stored = parent.num_stored
        child.status, child.started = parent.status, parent.started
        self.gpu.add_ref(table)
        if self.window is not None:
            self.window.fork(parent, child)
        self._seqs[child_id] = child
        if self.sink.enabled:
            emit = self.sink.emit
            emit(S.SEQ_ADD, seq=child_id, prompt_tokens=child.num_prompt_tokens,
                 priority=child.priority, parent=parent_id)
            emit(S.FORK, tier="gpu", seq=child_id, parent=parent_id, blocks=list(table))
            if child.status == "running":
                emit(S.SEQ_START, seq=child_id)
            if self.window is not None and child.window_table:
                emit(S.FORK, tier="gpu", seq=child_id, parent=parent_id, group=1,
                     blocks=child.window_table[child.window_first:])
        if num_private:
            logical = list(range(first_private, len(table)))
            src = table[first_private:]
            dst = self.gpu.allocate(num_private)
            for i, a, b in zip(logical, src, dst, strict=True):
                self._ref[a] -= 1  # stays >= 1: the parent keeps it
                child.block_table[i] = b
            if known % bs:
                self._copy_orders.append((src[0], dst[0]))
                self.num_cow_copies += 1
            if self.sink.enabled:
                self.sink.emit(S.COW, tier="gpu", seq=child_id, logical=logical, src=src,
                               dst=dst)

    def start(self, seq_id: str) -> None:
        """First schedule: waiting -> running."""
        seq = self._get(seq_id)
        if seq.started or seq.status != "waiting":
            raise CacheError(f"{seq_id!r} has already started (status {seq.status})")
        seq.status, seq.started = "running", True
        if self.sink.enabled:
            self.sink.seq_start(seq_id)

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
            self._asking(seq_id, C.R_SWAP_OUT)
            if self._swap_out(seq):
                seq.status = "swapped"
                if self.sink.enabled:
                    self.sink.emit(S.SEQ_PREEMPT, seq=seq_id, mode="swap", **extra)
                return "swap"
            self.num_swap_fallbacks += 1
            if cause is not None:
                extra = {"cause": {**cause, C.FALLBACK: "swap fell back to recompute: "
                                   "the host pool was full"}}
        self._free(seq)
        seq.status = "waiting"
        if self.sink.enabled:
            self.sink.emit(S.SEQ_PREEMPT, seq=seq_id, mode="recompute", **extra)
        return "recompute"

    def can_swap_in(self, seq_id: str, num_new_tokens: int = 0,
                    watermark: float = 0.0) -> bool:
        """Whether ``swap_in(seq_id)`` followed by ``allocate_slots(seq_id,
        num_new_tokens)`` would succeed and leave ``watermark * num_gpu_blocks`` blocks."""
        seq = self._swapped(seq_id)
        check_count(num_new_tokens)
        if not (isinstance(watermark, (int, float)) and 0.0 <= watermark < 1.0):
            raise CacheError(f"watermark must be in [0, 1), got {watermark!r}")
        _, need = self.host.swap_in_cost(seq.block_table)
        # after the swap-in its partial last block is private (unhashed: never shared)
        grow = -(-(seq.num_tokens + num_new_tokens) // self.block_size) - len(seq.block_table)
        if self.window_host is not None:  # group 1 (released entries were released before)
            _, w = self.window_host.swap_in_cost(seq.window_table[seq.window_first:])
            pool = self.window.pool
            if w + grow > pool.num_free_blocks - int(watermark * pool.capacity):
                return False
        return need + grow <= self.gpu.num_free_blocks - int(watermark * self.gpu.capacity)

    def swap_in(self, seq_id: str) -> bool:
        """Swapped -> running: the table moves back to gpu blocks (shared where the gpu
        still indexes the same content). False, with nothing changed, when the gpu pool is
        too full."""
        seq = self._swapped(seq_id)
        self._asking(seq_id, C.R_SWAP_IN)
        if not self._swap_in(seq):
            return False
        seq.status = "running"
        if self.enable_prefix_caching:
            self._store_full_blocks(seq)  # blocks whose ids arrived while swapped out
        if self.sink.enabled:
            self.sink.emit(S.SEQ_RESUME, seq=seq_id)
        return True

    def _swap_out(self, seq: CacheSeq) -> bool:
        """Both groups' tables to the host, or nothing when a host pool is short. Group 1
        moves only its held blocks (the window of the last computed token, as the decode
        steps left it); released entries stay released."""
        wh = self.window_host
        if wh is None:
            return self.host.swap_out(seq)
        keep = seq.window_table[seq.window_first:]
        if self.host.swap_out_cost(seq.block_table)[1] > self.host.host.num_free_blocks or \
                wh.swap_out_cost(keep)[1] > wh.host.num_free_blocks:
            return False
        self.host.swap_out(seq)
        seq.window_table[seq.window_first:] = wh.move_out(
            seq.seq_id, seq.window_table[seq.window_first:], seq.priority)
        return True

    def _swap_in(self, seq: CacheSeq) -> bool:
        """Both groups' tables back to the gpu, or nothing when a gpu pool is short."""
        wh = self.window_host
        if wh is None:
            return self.host.swap_in(seq)
        held = seq.window_table[seq.window_first:]
        if self.host.swap_in_cost(seq.block_table)[1] > self.gpu.num_free_blocks or \
                wh.swap_in_cost(held)[1] > self.window.pool.num_free_blocks:
            return False
        self.host.swap_in(seq)
        seq.window_table[seq.window_first:] = wh.move_in(seq.seq_id, held, seq.priority)
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
        if self.sink.enabled:
            self.sink.emit(S.SEQ_RESUME, seq=seq_id)

    def free(self, seq_id: str) -> None:
        """Drop the sequence's blocks; it stays known (status unchanged). A swapped
        sequence cannot be freed (it would be swapped with nothing): finish it instead."""
        seq = self._get(seq_id)
        if seq.status == "swapped":
            raise CacheError(f"{seq_id!r} is swapped out: finish it or swap it in")
        self._free(seq)

    def finish(self, seq_id: str, reason: str) -> None:
        """Free the sequence's blocks and forget it."""
        seq = self._get(seq_id)
        if reason not in S.FINISH_REASONS:
            raise CacheError(f"unknown finish reason {reason!r}; one of {S.FINISH_REASONS}")
        num_tokens = seq.num_tokens  # its last step's tokens: no seq_tokens will say it
        self._free(seq)
        if self.disk is not None:
            self.disk.give_up(seq_id, timed_out=False)
        del self._seqs[seq_id]
        if self.sink.enabled:
            self.sink.seq_finish(seq_id, reason, num_tokens,
                                 len(seq.token_ids) - seq.num_prompt_tokens)

    def _free(self, seq: CacheSeq) -> None:
        table = seq.block_table
        if not table:
            return
        if self.window is not None:
            held = self.window.release_all(seq)
            if held and self.sink.enabled:
                self.sink.emit(S.FREE, tier=seq.tier, seq=seq.seq_id, blocks=held, group=1)
        self.pools[seq.tier].release(table)
        if self.sink.enabled:
            self.sink.block_op(S.FREE, seq.tier, seq.seq_id, table)
        seq.drop_table()

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
        if self.host is not None and self.window is None:  # no host hits beside a window
            return self._match_both_tiers(seq)
        bs, toks, pool = self.block_size, seq.token_ids, self.gpu
        cached, entry = pool.cached, pool.entry
        blocks: list[int] = []
        ph, pid = seq.root_hash, seq.root_id
        # Lazily cut the matchable span (all but the last token) into bs-tuples.
        for chunk in zip(*[islice(toks, (len(toks) - 1) // bs * bs)] * bs, strict=True):
            h = hash((ph, chunk))
            b = cached.get(h)
            if b is None:
                break
            e = entry[b]
            if e[1] != pid or e[2] != chunk:  # a hash collision, not this prefix
                break
            blocks.append(b)
            pid = e[3]
            ph = h
        window_hit: list[int] = []
        if self.window is not None and blocks:
            # a hit also needs the window group's blocks of its last W tokens: the longest
            # prefix of the group-0 hit that has them (engine.cache.window_group)
            chain = [entry[b][::3] for b in blocks]  # (hash, serial) per block
            k, window_hit = self.window.longest_hit(chain)
            del blocks[k:]
            if blocks:
                ph, pid = chain[k - 1]
        num_hit = len(blocks) * bs
        self.num_query_tokens += len(toks)
        self.num_hit_tokens += num_hit
        if blocks:
            pool.share(blocks, seq.priority)
            seq.block_table = blocks
            seq.num_tokens = num_hit
            if self.sink.enabled:
                self._moved[seq_id] = seq
            seq.num_stored = len(blocks)
            seq.chain_hash, seq.chain_id = ph, pid
            if self.sink.enabled:
                self.sink.block_op(S.HIT, "gpu", seq_id, blocks, num_hit)
            if self.window is not None:
                self.window.take_hit(seq, len(blocks), window_hit)
                if window_hit and self.sink.enabled:
                    self.sink.emit(S.HIT, tier="gpu", seq=seq_id, blocks=list(window_hit),
                                   group=1)
        return num_hit

    def _match_both_tiers(self, seq: CacheSeq) -> int:
        """match_prefix over the gpu index, then the host index, block by block."""
        self._asking(seq.seq_id, C.R_HOST_HIT)
        bs, toks, gpu, host = self.block_size, seq.token_ids, self.gpu, self.host.host
        found: list[tuple[bool, int]] = []  # (on the host?, block), in table order
        ph, pid = seq.root_hash, seq.root_id
        for chunk in zip(*[islice(toks, (len(toks) - 1) // bs * bs)] * bs, strict=True):
            h = hash((ph, chunk))
            b = gpu.cached.get(h)
            if b is not None:
                e = gpu.entry[b]
                if e[1] != pid or e[2] != chunk:  # a collision: the host copy could not be
                    break  # indexed on the gpu under this hash either
                found.append((False, b))
            else:
                y = host.cached.get(h)
                if y is None:
                    break
                e = host.entry[y]
                if e[1] != pid or e[2] != chunk:
                    break
                found.append((True, y))
            pid = e[3]
            ph = h
        # Loading host blocks takes gpu blocks: keep the prefix that fits.
        room = gpu.num_free_blocks - sum(1 for on_host, b in found
                                         if not on_host and gpu.ref[b] == 0)
        for i, (on_host, _) in enumerate(found):
            if on_host:
                room -= 1
                if room < 0:
                    del found[i:]
                    break
        if not found:
            self.num_query_tokens += len(toks)
            return 0
        on_gpu = [b for on_host, b in found if not on_host]
        if on_gpu:  # revive first: loading the host blocks may evict cached gpu blocks
            gpu.share(on_gpu, seq.priority)
        loaded = iter(self.host.load([b for on_host, b in found if on_host], seq.priority))
        table = []
        runs: list[tuple[bool, list[int], list[int]]] = []  # (host?, src, table blocks)
        for on_host, b in found:
            x = next(loaded) if on_host else b
            table.append(x)
            if not runs or runs[-1][0] != on_host:
                runs.append((on_host, [], []))
            runs[-1][1].append(b)
            runs[-1][2].append(x)
        num_hit = len(table) * bs
        self.num_query_tokens += len(toks)
        self.num_hit_tokens += num_hit
        last = gpu.entry[table[-1]]
        seq.block_table = table
        seq.tier = "gpu"
        seq.num_tokens = num_hit
        if self.sink.enabled:
            self._moved[seq.seq_id] = seq
        seq.num_stored = len(table)
        seq.chain_hash, seq.chain_id = last[0], last[3]
        if self.sink.enabled:
            for on_host, src, dst in runs:
                if on_host:
                    self.sink.emit(S.HOST_HIT, seq=seq.seq_id, src=src, dst=dst,
                                   tokens=len(dst) * bs)
                else:
                    self.sink.block_op(S.HIT, "gpu", seq.seq_id, dst, len(dst) * bs)
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
        if self.disk is None:
            return
        self._asking("", C.R_WRITE_BACK)
        self.disk.host.reason = C.R_PREFETCH  # arrivals take host blocks
        self.disk.saved(saved)
        self.disk.arrived(loaded)
        if disabled and self.disk.enabled:
            self.disk.disable()

    def persist_to_disk(self) -> int:
        """A graceful stop: every cached gpu block is written back to the host, and every
        host-cached block the disk lacks is written to disk (bounded by the disk's size);
        returns the blocks queued for disk. The runner then performs the rounds and waits
        for the writes, bounded by its drain time."""
        if self.disk is None:
            return 0
        self._asking("", C.R_RESET)
        n0 = self.disk.stored_blocks
        gpu, host = self.gpu, self.host.host
        while len(gpu.evictable):  # written back to the host, whose evictions go to disk
            k = min(len(gpu.evictable), host.num_free_blocks)
            if not k:
                break
            gpu.evict(k)
        self.disk.save_all()
        return self.disk.stored_blocks - n0

    def adopt_disk(self, found: list[tuple[int, int, bool, tuple[int, ...]]]) -> int:
        """Index the blocks a warm disk directory holds, (hash, parent hash, first?,
        tokens), oldest first; returns how many fit (engine.cache.disk_tier.adopt)."""
        return self.disk.adopt(found) if self.disk is not None else 0

    def evict_cached(self, max_blocks: int | None = None) -> int:
        """Evict up to ``max_blocks`` (default: all) cached free blocks now, in policy
        order; returns how many. (Allocation evicts lazily; this is a prefix-cache reset.)"""
        if max_blocks is not None and (not is_int(max_blocks) or max_blocks < 0):
            raise CacheError(f"max_blocks must be an int >= 0, got {max_blocks!r}")
        if self.window is not None and max_blocks is None:  # without group 0's, useless
            self.window.evict()
        return self.gpu.evict(max_blocks)  # with a cpu tier, written back to the host

    def _store_full_blocks(self, seq: CacheSeq) -> None:
        """Index the sequence's newly full blocks whose token ids are known."""
        bs = self.block_size
        full = min(seq.num_tokens, len(seq.token_ids)) // bs
        first = seq.num_stored
        if first >= full or seq.tier != "gpu":  # swapped: stored when it is swapped in
            return
        pool = self.gpu
        cached, entry, serial = pool.cached, pool.entry, pool.num_stored
        host = self.host.host.cached if self.host is not None else None
        ph, pid = seq.chain_hash, seq.chain_id
        stored = []
        # vLLM's BlockStored needs each stored block's parent hash and tokens (sink.py)
        detail = self.sink.enabled and getattr(self.sink, "store_detail", False)
        parents: list[int | None] = []
        first_block = seq.block_table[0] if seq.block_table else None
        # zip(*[it] * bs) cuts the token span into bs-tuples at C speed.
        chunks = zip(*[iter(seq.token_ids[first * bs:full * bs])] * bs, strict=True)
        prompt_blocks = seq.num_prompt_tokens // bs
        # the window group indexes its blocks of the same contents (window_group.store)
        win: list[tuple[int, Any]] | None = [] if self.window is not None else None
        for i, (b, chunk) in enumerate(zip(seq.block_table[first:full], chunks, strict=True),
                                       first):
            ppid = pid
            h = hash((ph, chunk))
            e = entry[b]
            if e is not None:  # indexed already (shared with a sequence that got there first)
                pid = e[3]
            elif pid is not None:
                other = cached.get(h)
                if other is None:
                    # A content the host still holds keeps its serial (host_tier docstring).
                    y = host.get(h) if host else None
                    he = self.host.host.entry[y] if y is not None else None
                    if he is not None and he[1] == pid and he[2] == chunk:
                        entry[b] = he
                        pid = he[3]
                    else:
                        serial += 1
                        entry[b] = (h, pid, chunk, serial, ph)
                        pid = serial
                    cached[h] = b
                    stored.append(b)
                    if i < prompt_blocks:
                        seq.prompt_written += bs
                    if detail:
                        parents.append(None if b == first_block else ph)
                else:  # the same content under another block stays the indexed one
                    oe = entry[other]
                    pid = oe[3] if oe[1] == pid and oe[2] == chunk else None
            if win is not None and pid is not None:
                win.append((i, (h, ppid, chunk, pid, ph)))
            ph = h
        seq.num_stored = full
        seq.chain_hash, seq.chain_id = ph, pid
        pool.num_stored = serial
        if stored:
            pool.evictable.touch(stored, seq.priority)
            if detail:
                self.sink.emit(S.STORE, tier="gpu", blocks=stored,
                               hashes=[entry[b][0] for b in stored], **{
                                   S.STORE_PARENTS: parents,
                                   S.STORE_TOKENS: [entry[b][2] for b in stored]})
            elif self.sink.enabled:
                self.sink.store("gpu", stored, [entry[b][0] for b in stored])
        if win:
            wstored = self.window.store(seq, win)
            if wstored and self.sink.enabled:
                wentry = self.window.pool.entry
                self.sink.emit(S.STORE, tier="gpu", group=1, blocks=wstored,
                               hashes=[wentry[b][0] for b in wstored])

    # ------------------------------------------------------------ allocation
    def can_allocate(self, seq_id: str, num_new_tokens: int, watermark: float = 0.0) -> bool:
        """Whether ``allocate_slots(seq_id, num_new_tokens)`` would succeed and still leave
        ``watermark * num_gpu_blocks`` blocks (free or evictable) for running sequences."""
        seq = self._get(seq_id)
        check_count(num_new_tokens)
        if not (isinstance(watermark, (int, float)) and 0.0 <= watermark < 1.0):
            raise CacheError(f"watermark must be in [0, 1), got {watermark!r}")
        if seq.tier != "gpu":
            raise CacheError(f"{seq_id!r} is swapped out: use can_swap_in")
        need = self._blocks_needed(seq, num_new_tokens)
        reserve = int(watermark * self.gpu.capacity)
        if self.window is not None:
            w = self.window.needed(seq, num_new_tokens)
            if w > 0 and w > self.window.pool.num_free_blocks - int(
                    watermark * self.window.pool.capacity):
                return False
        return need == 0 or need <= self.gpu.num_free_blocks - reserve

    def allocate_slots(self, seq_id: str, num_new_tokens: int) -> list[int] | None:
        """Slots for the next ``num_new_tokens`` token positions of the sequence, allocating
        (and copying-on-write) blocks as needed; None, with nothing changed, when the pool
        has too few blocks."""
        seq = self._seqs.get(seq_id)
        if seq is not None and num_new_tokens == 1:
            # Decode fast path: one more slot in a private, partly filled last block.
            n = seq.num_tokens
            bs = self.block_size
            off = n % bs
            if off and seq.tier == "gpu":
                last = seq.block_table[-1]
                if self._ref[last] == 1:
                    if self.window is not None:  # release what left the window
                        out = self.window.release_before(seq, n)
                        if out and self.sink.enabled:
                            self.sink.emit(S.RELEASE, tier="gpu", seq=seq_id, group=1,
                                           blocks=out)
                    seq.num_tokens = n + 1
                    if self.sink.enabled:
                        self._moved[seq_id] = seq
                    if off + 1 == bs and self.enable_prefix_caching:
                        self._store_full_blocks(seq)
                    return [last * bs + off]
        if seq is None:
            self._get(seq_id)  # raises
        check_count(num_new_tokens)
        if seq.tier != "gpu":
            raise CacheError(f"{seq_id!r} is swapped out: swap it in before allocating")
        return self._allocate(seq, num_new_tokens)

    def blocks_needed(self, seq_id: str, num_new_tokens: int) -> int:
        """GPU blocks ``allocate_slots(seq_id, num_new_tokens)`` would take."""
        return self._blocks_needed(self._get(seq_id), num_new_tokens)

    def _asking(self, seq_id: str, reason: str) -> None:
        """Name who allocates next and why, for the cause of any eviction it forces (the
        host pool's evictions then make room for write-backs, or for a swap-out)."""
        host_reason = C.R_SWAP_OUT if reason == C.R_SWAP_OUT else C.R_WRITE_BACK
        for pool in self.pools.values():
            pool.requester = seq_id
            pool.reason = reason if pool is self.gpu else host_reason
        if self.window is not None:
            self.window.pool.requester, self.window.pool.reason = seq_id, reason
            if self.window.host is not None:
                self.window.host.requester, self.window.host.reason = seq_id, host_reason

    def _blocks_needed(self, seq: CacheSeq, n: int) -> int:
        if n == 0:
            return 0
        bs, num = self.block_size, seq.num_tokens
        need = -(-(num + n) // bs) - len(seq.block_table)
        if num % bs and self._ref[seq.block_table[-1]] > 1:
            need += 1  # copy-on-write of the shared partial last block
        return need

    def _allocate(self, seq: CacheSeq, n: int) -> list[int] | None:
        if n == 0:
            return []
        need = self._blocks_needed(seq, n)
        pool, table, bs = self.gpu, seq.block_table, self.block_size
        if need > pool.num_free_blocks:
            return None
        if self.window is not None and \
                self.window.needed(seq, n) > self.window.pool.num_free_blocks:
            return None
        start = seq.num_tokens
        if need:
            self._asking(seq.seq_id, C.R_ALLOCATE)
        blocks = pool.allocate(need) if need else []
        if start % bs and self._ref[table[-1]] > 1:
            src, dst = table[-1], blocks[0]
            blocks = blocks[1:]
            self._ref[src] -= 1  # stays >= 1: the other holders keep it
            table[-1] = dst
            self._copy_orders.append((src, dst))
            self.num_cow_copies += 1
            if self.sink.enabled:
                self.sink.emit(S.COW, tier="gpu", seq=seq.seq_id, logical=[len(table) - 1],
                               src=[src], dst=[dst])
        if blocks:
            table += blocks
            seq.tier = "gpu"  # as the mirror's alloc does (a table emptied on the cpu)
            if self.sink.enabled:
                self.sink.block_op(S.ALLOC, "gpu", seq.seq_id, blocks)
        if self.window is not None:
            self._allocate_window(seq, n)
        seq.num_tokens = end = start + n
        if self.sink.enabled:
            self._moved[seq.seq_id] = seq
        if self.enable_prefix_caching and min(end, len(seq.token_ids)) // bs > seq.num_stored:
            self._store_full_blocks(seq)
        return slot_mapping(table, bs, start, end)

    def _allocate_window(self, seq: CacheSeq, n: int) -> None:
        """The window group's share of ``_allocate`` (before ``num_tokens`` moves on).
        The release comes first, in the events too: the allocation may evict the very
        blocks it released (cached ones), and the mirror must see them released first."""
        window, emit, sid = self.window, self.sink.emit, seq.seq_id
        released = window.release_before(seq, seq.num_tokens)
        if released and self.sink.enabled:
            emit(S.RELEASE, tier="gpu", seq=sid, group=1, blocks=released)
        window.pool.requester, window.pool.reason = sid, C.R_ALLOCATE
        blocks, _, cow = window.allocate(seq, n)
        if not self.sink.enabled:
            return
        if cow:  # the last entry before the new ones; the mirror's table holds held ones
            emit(S.COW, tier="gpu", seq=sid, group=1,
                 logical=[len(seq.window_table) - len(blocks) - 1 - seq.window_first],
                 src=[cow[0]], dst=[cow[1]])
        if blocks:
            emit(S.ALLOC, tier="gpu", seq=sid, group=1, blocks=blocks)

    def _drop_window_twins(self, victims: list[int], entries: list[Any]) -> None:
        """Group 0 evicted these contents: their cached window blocks can never be hit
        again (a hit walks group 0 first), so they leave the window index too, and a
        later store of the same content under its new serial finds the hash free."""
        pool = self.window.pool
        cached, entry, ref = pool.cached, pool.entry, pool.ref
        twins = []
        for e in entries:
            o = cached.get(e[0])
            if o is not None and ref[o] == 0 and entry[o][3] == e[3]:
                twins.append(o)
        if twins:
            gpu = self.gpu
            pool.drop(twins, {C.POLICY: "twin", C.REASON: gpu.reason,
                              C.NEEDED_BY: gpu.requester})

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
        return plan_rounds(self.host.take_orders()) if self.host is not None else []

    def take_window_swap_rounds(self) -> list[Round]:
        """``take_swap_rounds`` of the window group (group 1): copies between its gpu pool
        and its host pool, which address the windowed layers' pages. Independent of group
        0's rounds (disjoint blocks and pages), so either may run first."""
        return plan_rounds(self.window_host.take_orders()) if self.window_host else []

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
        for ONE batched gather-then-scatter: a block demoted twice (int8, then int4) is
        one order from its full-precision page straight to its int4 page (better codes,
        and no order reads a page another order of the batch writes first)."""
        origin: dict[int, int] = {}  # destination -> where its data is now
        for old, new in self._demotion_orders:
            origin[new] = origin.pop(old, old)
        self._demotion_orders = []
        return [(src, dst) for dst, src in origin.items()]

    def page_codes(self, table: list[int]) -> list[int]:
        """The kernels' page codes of a block table (mixed pools only)."""
        code = self.gpu.page_code
        return [code(b) for b in table]

    def take_copy_orders(self) -> list[tuple[int, int]]:
        """The (src, dst) block copies queued by copy-on-write since the last call. The
        runner performs them before the step's forward pass."""
        out, self._copy_orders = self._copy_orders, []
        return out

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
        if not moved or not self.sink.enabled:
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
            self.sink.seq_tokens(seqs, counts)  # both handed over

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
