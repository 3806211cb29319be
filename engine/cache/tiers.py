"""CacheTiers: the block pools of every tier and group, and the moves between them.

The coordinator under ``KVCacheManager`` (manager.py): it validates the pool sizes, builds
the pools (``BlockPool`` per tier, a ``MixedBlockPool`` gpu pool with kv demotion), the
host tier (``HostTier``: swap space and write-back prefix cache), the disk tier
(``DiskTier``) and the sliding-window group (``WindowGroup``, with its own host pool),
and performs what spans them: swapping a sequence's tables out and in (both groups or
neither), naming the requester of the next allocation (eviction causes), prefix-cache
resets and the disk tier's persistence.

Invariants:
- ``pools`` holds one pool per tier with a non-zero size, in ``S.TIERS`` order; ``gpu`` is
  ``pools["gpu"]``; ``host`` exists exactly when ``pools`` has "cpu", ``disk`` exactly
  when it has "disk" (which needs "cpu" and prefix caching).
- A window group's pools are not in ``pools`` (they are ``window.pool``/``window.host``,
  group 1); its cpu pool exists exactly when group 0's does.
- A swap moves both groups' tables or neither: the costs are checked before anything
  moves, so a refused swap changes nothing.
It works on ``CacheSeq`` records handed to it and never imports the manager.
"""

from __future__ import annotations

from typing import Any

from kvscope.engine.cache.block_pool import BlockPool
from kvscope.engine.cache.demotion import DemotionPolicy
from kvscope.engine.cache.disk_tier import DiskTier
from kvscope.engine.cache.errors import CacheError
from kvscope.engine.cache.eviction import make_policy
from kvscope.engine.cache.host_tier import HostTier
from kvscope.engine.cache.mixed_pool import MixedBlockPool
from kvscope.engine.cache.sequence import CacheSeq
from kvscope.engine.cache.transfers import Round, plan_rounds
from kvscope.engine.cache.validation import is_int
from kvscope.engine.cache.window_group import WindowGroup
from kvscope.engine.events import causes as C
from kvscope.engine.events import schema as S
from kvscope.engine.events.sink import EventSink


def check_config(
    num_gpu_blocks: int, block_size: int, num_cpu_blocks: int, num_disk_blocks: int,
    enable_prefix_caching: bool, kv_format: str, demotion: DemotionPolicy | None,
    window: int | None, num_window_blocks: int, num_window_cpu_blocks: int,
) -> None:
    """Raise CacheError for sizes or combinations the cache cannot hold."""
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
    if demotion is not None and num_cpu_blocks:
        raise CacheError("kv demotion and a cpu tier cannot be combined yet: swapped "
                         "and offloaded blocks would need per-block formats on the host")


class CacheTiers:
    def __init__(
        self, num_gpu_blocks: int, block_size: int, *, num_cpu_blocks: int,
        num_disk_blocks: int, enable_prefix_caching: bool, eviction_policy: str,
        kv_format: str, sink: EventSink, demotion: DemotionPolicy | None,
        window: int | None, num_window_blocks: int, num_window_cpu_blocks: int,
    ) -> None:
        """Build the pools (the arguments are ``KVCacheManager``'s, already checked by
        ``check_config``) and emit ``tier_init`` per pool."""
        self.block_size = block_size
        self.pools: dict[str, BlockPool] = {}
        sizes = {"gpu": num_gpu_blocks, "cpu": num_cpu_blocks, "disk": num_disk_blocks}
        if demotion is not None:
            self.pools["gpu"] = MixedBlockPool(
                "gpu", num_gpu_blocks, demotion.subs, block_size, kv_format,
                make_policy(eviction_policy), sink)
        for tier in S.TIERS:
            if sizes[tier] and tier not in self.pools:
                self.pools[tier] = BlockPool(
                    tier, sizes[tier], block_size, kv_format,
                    make_policy("lru" if tier == "disk" else eviction_policy), sink,
                )
        self.gpu = self.pools["gpu"]
        self.host: HostTier | None = None
        if "cpu" in self.pools:  # beside a window group: swap space only (window_group)
            self.host = HostTier(self.gpu, self.pools["cpu"], sink,
                                 write_back=enable_prefix_caching and window is None)
        self.disk: DiskTier | None = None
        if "disk" in self.pools:
            self.disk = DiskTier(self.gpu, self.host, self.pools["disk"], sink)
        # group 1, the sliding-window layers' blocks (engine.cache.window_group), or None
        self.window: WindowGroup | None = None
        self.window_host: HostTier | None = None  # group 1's swaps (its own host pool)
        if window is not None:  # its evictions name group 1 (BlockPool.group)
            pools = [BlockPool(tier, n, block_size, kv_format, make_policy("lru"), sink)
                     for tier, n in (("gpu", num_window_blocks), ("cpu", num_window_cpu_blocks))
                     if n]
            for pool in pools:
                pool.group = 1
            self.window = WindowGroup(pools[0], window, pools[1] if len(pools) > 1 else None)
            if self.window.host is not None:
                self.window_host = HostTier(self.window.pool, self.window.host, sink,
                                            write_back=False)
            # the host tier does not write back beside a window group: the hook is free
            self.gpu.writeback = self._drop_window_twins
        if sink.enabled:
            for pool in self.pools.values():
                sink.emit(S.TIER_INIT, tier=pool.tier, num_blocks=pool.num_blocks,
                          block_size=block_size, format=kv_format)
            if self.window is not None:
                sink.emit(S.TIER_INIT, tier="gpu", num_blocks=num_window_blocks,
                          block_size=block_size, format=kv_format, group=1)
            if self.window_host is not None:
                sink.emit(S.TIER_INIT, tier="cpu", num_blocks=num_window_cpu_blocks,
                          block_size=block_size, format=kv_format, group=1)

    def asking(self, seq_id: str, reason: str) -> None:
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

    # ------------------------------------------------------------- swapping
    def swap_in_fits(self, seq: CacheSeq, num_new_tokens: int, watermark: float) -> bool:
        """Whether the swapped sequence's swap-in, then ``num_new_tokens`` more slots, fit
        and leave ``watermark`` of each gpu pool (free or evictable)."""
        _, need = self.host.swap_in_cost(seq.block_table)
        # after the swap-in its partial last block is private (unhashed: never shared)
        grow = -(-(seq.num_tokens + num_new_tokens) // self.block_size) - len(seq.block_table)
        if self.window_host is not None:  # group 1 (released entries were released before)
            _, w = self.window_host.swap_in_cost(seq.window_table[seq.window_first:])
            pool = self.window.pool
            if w + grow > pool.num_free_blocks - int(watermark * pool.capacity):
                return False
        return need + grow <= self.gpu.num_free_blocks - int(watermark * self.gpu.capacity)

    def swap_out(self, seq: CacheSeq) -> bool:
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

    def swap_in(self, seq: CacheSeq) -> bool:
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

    def take_swap_rounds(self) -> list[Round]:
        """Group 0's queued copies between tiers, batched (engine.cache.transfers)."""
        return plan_rounds(self.host.take_orders()) if self.host is not None else []

    def take_window_swap_rounds(self) -> list[Round]:
        """Group 1's queued copies between its gpu and host pools, batched."""
        return plan_rounds(self.window_host.take_orders()) if self.window_host else []

    # ----------------------------------------------------- resets, the disk
    def evict_cached(self, max_blocks: int | None) -> int:
        """Evict up to ``max_blocks`` (None: all) cached free gpu blocks now."""
        if self.window is not None and max_blocks is None:  # without group 0's, useless
            self.window.evict()
        return self.gpu.evict(max_blocks)  # with a cpu tier, written back to the host

    def disk_results(self, saved: list[tuple[int, int, bool]],
                     loaded: list[tuple[int, bool]], disabled: bool) -> None:
        """Hand the runner's disk outcomes to the disk tier (which exists)."""
        self.asking("", C.R_WRITE_BACK)
        self.disk.host.reason = C.R_PREFETCH  # arrivals take host blocks
        self.disk.saved(saved)
        self.disk.arrived(loaded)
        if disabled and self.disk.enabled:
            self.disk.disable()

    def persist_to_disk(self) -> int:
        """Write every cached gpu block back to the host and every host-cached block the
        disk lacks to disk (the disk tier exists); returns the blocks queued for disk."""
        self.asking("", C.R_RESET)
        n0 = self.disk.stored_blocks
        gpu, host = self.gpu, self.host.host
        while len(gpu.evictable):  # written back to the host, whose evictions go to disk
            k = min(len(gpu.evictable), host.num_free_blocks)
            if not k:
                break
            gpu.evict(k)
        self.disk.save_all()
        return self.disk.stored_blocks - n0
