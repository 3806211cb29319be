"""HostTier: the "cpu" pool as swap space and as a write-back prefix cache (pure Python).

Three ways blocks move between the tiers, each queued as swap orders
(engine.cache.transfers) that the runner executes before the step's forward pass:

- swap-out (``swap_out``): a preempted sequence's whole table moves to host blocks and its
  gpu blocks are released. A full block whose content the host already indexes (same
  cache entry) is not copied again: the sequence shares that host block. So a block shared
  by several sequences (a common prefix) has one host copy however many of them are
  swapped out. Hashed blocks that are copied are indexed on the host too (event
  ``offload`` before ``swap_out``): when the sequence comes back, its host copies stay
  behind as host prefix cache.
- swap-in (``swap_in``): the table moves back; a full block whose content the gpu already
  indexes is shared instead of copied, the others get fresh gpu blocks (evicting cached
  ones if needed) and keep their index entries there (event ``store``).
- write-back (``write_back``, the gpu pool's eviction hook) and host hits (``match``):
  a cached gpu block that is evicted is first copied to a host block (event ``offload``)
  unless the host already holds its content; the host pool evicts in its own policy
  order (LRU by default) when it is full. A prefix lookup that runs past the gpu index
  continues in the host index and loads those blocks into fresh gpu blocks (``host_hit``)
  instead of recomputing them.

Cache entries are (hash, parent_id, tokens, serial) as in BlockPool. A serial names a
content, not a block: a copy between tiers keeps its entry, and the gpu reuses the host's
serial when it stores a content the host still holds, so a prefix chain verified block by
block stays valid when its blocks are spread over both tiers.

One HostTier moves the blocks of one cache group: group 0 (``BlockPool.group`` of
``gpu``); a hybrid cache's window group has its own (``move_out``/``move_in`` of its held
window blocks, events naming group 1; engine.cache.window_group), without write-back.

NOTE: orders are sequential in meaning (transfers.plan_rounds batches them safely). A
sequence's blocks are all computed when it is swapped out or evicted: the scheduler only
picks victims that were not scheduled in the current step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvscope.engine.cache.block_pool import BlockPool, Entry
from kvscope.engine.cache.transfers import IN, OUT, Order
from kvscope.engine.events import schema as S
from kvscope.engine.events.sink import EventSink

if TYPE_CHECKING:
    from kvscope.engine.cache.sequence import CacheSeq


class HostTier:
    def __init__(self, gpu: BlockPool, host: BlockPool, sink: EventSink,
                 write_back: bool) -> None:
        self.gpu, self.host, self.sink = gpu, host, sink
        self.group = gpu.group  # the KV cache group whose blocks move (hybrid cache: 0 or 1)
        self.orders: list[Order] = []
        if write_back:
            gpu.writeback = self.write_back
        # counters (engine.cache.report.metrics)
        self.num_swap_outs = 0  # sequences swapped out
        self.num_swap_ins = 0
        self.swapped_out_blocks = 0  # table entries moved to the host (shared ones included)
        self.swapped_in_blocks = 0
        self.copied_out_blocks = 0  # gpu -> host block copies (swap-out and write-back)
        self.copied_in_blocks = 0  # host -> gpu block copies (swap-in and host hits)
        self.offloaded_blocks = 0  # evicted gpu blocks written back to the host
        self.host_hit_blocks = 0

    # ------------------------------------------------------------- swapping
    def swap_out_cost(self, table: list[int]) -> tuple[list[int | None], int]:
        """Per gpu block of ``table``: the host block already holding its content, or None;
        and how many host blocks the swap-out would take (fresh plus revived)."""
        return _dedup_plan(table, self.gpu, self.host)

    def swap_out(self, seq: CacheSeq) -> bool:
        """Move ``seq``'s table to the host; False (nothing changed) when the host pool is
        too full."""
        dst = self.move_out(seq.seq_id, seq.block_table, seq.priority)
        if dst is None:
            return False
        seq.block_table = dst
        seq.tier = "cpu"
        return True

    def move_out(self, seq_id: str, table: list[int], priority: int) -> list[int] | None:
        """Copy the held blocks ``table`` of a sequence to host blocks and release them on
        the gpu; returns the host table, or None (nothing changed) when the host pool is
        too full. Events name ``group`` (a hybrid cache's window group: 1)."""
        gpu, host = self.gpu, self.host
        plan, need = self.swap_out_cost(table)
        if need > host.num_free_blocks:
            return None
        reused = [y for y in plan if y is not None]
        if reused:
            host.share(reused, priority)
        fresh = iter(host.allocate(len(table) - len(reused)))
        dst: list[int] = []
        indexed: list[int] = []
        copied_src: list[int] = []
        for b, y in zip(table, plan, strict=True):
            if y is None:
                y = next(fresh)
                self.orders.append((OUT, b, y))
                e = gpu.entry[b]
                if e is not None and e[0] not in host.cached:
                    host.entry[y] = e
                    host.cached[e[0]] = y
                    indexed.append(y)
                    copied_src.append(b)
            dst.append(y)
        if indexed:
            host.evictable.touch(indexed, priority)
        gpu.release(table)
        self.num_swap_outs += 1
        self.swapped_out_blocks += len(table)
        self.copied_out_blocks += len(table) - len(reused)
        if self.sink.enabled:
            extra = {"group": self.group} if self.group else {}
            if indexed:  # the host copies get their hashes while their ref is still 0
                self.sink.emit(S.OFFLOAD, src=copied_src, dst=indexed,
                               hashes=[host.entry[y][0] for y in indexed], **extra)
            self.sink.emit(S.SWAP_OUT, seq=seq_id, src=list(table), dst=dst, **extra)
        return dst

    def swap_in_cost(self, table: list[int]) -> tuple[list[int | None], int]:
        """Per host block of ``table``: the gpu block already holding its content, or None;
        and how many gpu blocks the swap-in would take (fresh plus revived)."""
        return _dedup_plan(table, self.host, self.gpu)

    def swap_in(self, seq: CacheSeq) -> bool:
        """Move ``seq``'s table back to the gpu; False (nothing changed) when the gpu pool is
        too full."""
        dst = self.move_in(seq.seq_id, seq.block_table, seq.priority)
        if dst is None:
            return False
        seq.block_table = dst
        seq.tier = "gpu"
        return True

    def move_in(self, seq_id: str, table: list[int], priority: int) -> list[int] | None:
        """Bring the host table ``table`` of a sequence back into gpu blocks (shared where
        the gpu indexes the same content) and release the host blocks; returns the gpu
        table, or None (nothing changed) when the gpu pool is too full."""
        gpu, host = self.gpu, self.host
        plan, need = self.swap_in_cost(table)
        if need > gpu.num_free_blocks:
            return None
        reused = [x for x in plan if x is not None]
        if reused:
            gpu.share(reused, priority)  # before allocating: it may evict cached blocks
        # Evictions here write back to the host; the table's host blocks have ref > 0, so
        # the host cannot evict them to make room.
        fresh = iter(gpu.allocate(len(table) - len(reused)))
        dst: list[int] = []
        stored: list[int] = []
        for y, x in zip(table, plan, strict=True):
            if x is None:
                x = next(fresh)
                self.orders.append((IN, y, x))
                e = host.entry[y]
                if e is not None and e[0] not in gpu.cached:
                    gpu.entry[x] = e
                    gpu.cached[e[0]] = x
                    stored.append(x)
            dst.append(x)
        if stored:
            gpu.evictable.touch(stored, priority)
        host.release(table)  # hashed host blocks stay behind as host prefix cache
        self.num_swap_ins += 1
        self.swapped_in_blocks += len(table)
        self.copied_in_blocks += len(table) - len(reused)
        if self.sink.enabled:
            extra = {"group": self.group} if self.group else {}
            self.sink.emit(S.SWAP_IN, seq=seq_id, src=list(table), dst=dst, **extra)
            if stored:
                self.sink.emit(S.STORE, tier="gpu", blocks=stored,
                               hashes=[gpu.entry[x][0] for x in stored], **extra)
        return dst

    # ---------------------------------------------------------- prefix cache
    def write_back(self, victims: list[int], entries: list[Entry]) -> None:
        """The gpu pool evicted ``victims`` (cached, ref 0): copy those whose content the
        host does not hold yet into host blocks, as many as the host can take."""
        host = self.host
        todo = [(b, e) for b, e in zip(victims, entries, strict=True)
                if e[0] not in host.cached]
        todo = todo[:host.num_free_blocks]
        if not todo:
            return
        dst = host.take(len(todo))  # may evict host-cached blocks (event evict, tier cpu)
        for (b, e), y in zip(todo, dst, strict=True):
            host.entry[y] = e
            host.cached[e[0]] = y
            self.orders.append((OUT, b, y))
        host.evictable.push(dst)
        self.offloaded_blocks += len(dst)
        self.copied_out_blocks += len(dst)
        if self.sink.enabled:
            self.sink.emit(S.OFFLOAD, src=[b for b, _ in todo], dst=dst,
                           hashes=[e[0] for _, e in todo])

    def load(self, host_blocks: list[int], priority: int) -> list[int]:
        """Copy host-cached blocks into fresh gpu blocks that take over their index entries
        (a host prefix hit). The caller has checked that the gpu pool has room and that no
        gpu block is indexed under their hashes."""
        gpu, host = self.gpu, self.host
        # Out of the host's eviction order while the gpu allocation writes back evicted
        # blocks, which could otherwise take these very host blocks.
        idle = [y for y in host_blocks if host.ref[y] == 0]
        host.evictable.remove(idle)
        fresh = gpu.allocate(len(host_blocks))
        host.evictable.push(idle)  # a hit makes them the most recently used
        host.evictable.touch(host_blocks, priority)
        for y, x in zip(host_blocks, fresh, strict=True):
            e = host.entry[y]
            gpu.entry[x] = e
            gpu.cached[e[0]] = x
            self.orders.append((IN, y, x))
        gpu.evictable.touch(fresh, priority)
        self.host_hit_blocks += len(fresh)
        self.copied_in_blocks += len(fresh)
        return fresh

    def take_orders(self) -> list[Order]:
        out, self.orders = self.orders, []
        return out


def _dedup_plan(table: list[int], src, dst) -> tuple[list[int | None], int]:
    """Moving ``table`` from pool ``src`` to pool ``dst``: per block, the ``dst`` block that
    already holds the same content (same hash and same cache entry serial), or None; and how
    many ``dst`` blocks the move takes (fresh ones plus cached free ones it revives)."""
    plan: list[int | None] = []
    need = 0
    for b in table:
        e = src.entry[b]
        y = dst.cached.get(e[0]) if e is not None else None
        if y is not None and dst.entry[y][3] == e[3]:
            plan.append(y)
            need += dst.ref[y] == 0  # reviving it takes it from the allocatable ones
        else:
            plan.append(None)
            need += 1
    return plan, need
