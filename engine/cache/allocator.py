"""SlotAllocator: gpu blocks for new token positions, copy-on-write, and freeing.

The allocation half of the manager (manager.py), over the pools of ``CacheTiers``
(tiers.py) and the ``CacheSeq`` records the manager hands in. It counts the blocks an
allocation needs, allocates them (group 0, and the window group's share), moves a
sequence off a shared partial last block before writing into it (copy-on-write), forks
a sequence (shared blocks, private copies of its lookahead blocks), and releases tables.

Invariants:
- An allocation either happens whole or not at all: ``allocate`` checks both groups'
  free blocks before it takes any, and returns None with nothing changed.
- After ``allocate(seq, n)``: ``len(seq.block_table) == ceil(seq.num_tokens / bs)`` and
  the last block is private to ``seq`` (ref 1) when it is partly filled.
- Every copy-on-write queues one (src, dst) order, taken by ``take_copy_orders``; the
  source keeps ref >= 1 (its other holders).
Newly full blocks are handed to the prefix index (``store``) as soon as their ids are
known. Marking the sequence's token count as moved is left to the manager.
"""

from __future__ import annotations

from kvscope.engine.cache.errors import CacheError
from kvscope.engine.cache.prefix_index import PrefixIndex
from kvscope.engine.cache.sequence import CacheSeq
from kvscope.engine.cache.slots import slot_mapping
from kvscope.engine.cache.tiers import CacheTiers
from kvscope.engine.events import causes as C
from kvscope.engine.events import schema as S
from kvscope.engine.events.sink import EventSink


class SlotAllocator:
    def __init__(self, tiers: CacheTiers, index: PrefixIndex, sink: EventSink,
                 enable_prefix_caching: bool) -> None:
        self.tiers = tiers
        self.index = index
        self.sink = sink  # the manager's; replaced with it (KVCacheManager.sink)
        self.block_size = tiers.block_size
        self.gpu = tiers.gpu
        self.ref = tiers.gpu.ref
        self.pools = tiers.pools
        self.window = tiers.window
        self.enable_prefix_caching = enable_prefix_caching
        self.copy_orders: list[tuple[int, int]] = []
        self.num_cow_copies = 0

    def blocks_needed(self, seq: CacheSeq, n: int) -> int:
        """GPU blocks ``allocate(seq, n)`` would take (a copy-on-write counts one)."""
        if n == 0:
            return 0
        bs, num = self.block_size, seq.num_tokens
        need = -(-(num + n) // bs) - len(seq.block_table)
        if num % bs and self.ref[seq.block_table[-1]] > 1:
            need += 1  # copy-on-write of the shared partial last block
        return need

    def fits(self, seq: CacheSeq, n: int, watermark: float) -> bool:
        """Whether ``allocate(seq, n)`` would succeed and leave ``watermark`` of each gpu
        pool's blocks (free or evictable)."""
        need = self.blocks_needed(seq, n)
        reserve = int(watermark * self.gpu.capacity)
        if self.window is not None:
            w = self.window.needed(seq, n)
            if w > 0 and w > self.window.pool.num_free_blocks - int(
                    watermark * self.window.pool.capacity):
                return False
        return need == 0 or need <= self.gpu.num_free_blocks - reserve

    def allocate(self, seq: CacheSeq, n: int) -> list[int] | None:
        """Slots for the next ``n`` positions of ``seq`` (on the gpu), allocating and
        copying-on-write as needed; None, with nothing changed, when a pool is short."""
        if n == 0:
            return []
        need = self.blocks_needed(seq, n)
        pool, table, bs = self.gpu, seq.block_table, self.block_size
        if need > pool.num_free_blocks:
            return None
        if self.window is not None and \
                self.window.needed(seq, n) > self.window.pool.num_free_blocks:
            return None
        start = seq.num_tokens
        if need:
            self.tiers.asking(seq.seq_id, C.R_ALLOCATE)
        blocks = pool.allocate(need) if need else []
        if start % bs and self.ref[table[-1]] > 1:
            src, dst = table[-1], blocks[0]
            blocks = blocks[1:]
            self.ref[src] -= 1  # stays >= 1: the other holders keep it
            table[-1] = dst
            self.copy_orders.append((src, dst))
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
        if self.enable_prefix_caching and min(end, len(seq.token_ids)) // bs > seq.num_stored:
            self.index.store(seq)
        return slot_mapping(table, bs, start, end)

    def _allocate_window(self, seq: CacheSeq, n: int) -> None:
        """The window group's share of ``allocate`` (before ``num_tokens`` moves on).
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

    def fork(self, parent: CacheSeq, child_id: str) -> CacheSeq:
        """A new sequence ``child_id`` sharing every block of ``parent`` (ref + 1), with
        its token ids, counts and status; emits the child's ``seq_add``, ``fork`` (and
        ``seq_start`` when it runs). Blocks holding slots of not yet known tokens get
        private copies at once (``cow``; a copy order only for the block whose first
        positions are computed). Raises CacheError, with nothing changed, when the window
        group would need private copies or the pool is short of them. The caller checked
        the ids and that the parent is on the gpu, and registers the child."""
        parent_id = parent.seq_id
        bs, table, known = self.block_size, parent.block_table, len(parent.token_ids)
        first_private = known // bs if parent.num_tokens > known else len(table)
        num_private = len(table) - first_private
        if num_private and self.window is not None:
            raise CacheError(f"cannot fork {parent_id!r}: its lookahead slots would need "
                             "private window-group copies (not supported yet)")
        self.tiers.asking(child_id, C.R_FORK)
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
        child.chain_hash, child.chain_id = parent.chain_hash, parent.chain_id
        child.num_stored = parent.num_stored
        child.status, child.started = parent.status, parent.started
        self.gpu.add_ref(table)
        if self.window is not None:
            self.window.fork(parent, child)
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
                self.ref[a] -= 1  # stays >= 1: the parent keeps it
                child.block_table[i] = b
            if known % bs:
                self.copy_orders.append((src[0], dst[0]))
                self.num_cow_copies += 1
            if self.sink.enabled:
                self.sink.emit(S.COW, tier="gpu", seq=child_id, logical=logical, src=src,
                               dst=dst)
        return child

    def free(self, seq: CacheSeq) -> None:
        """Release both groups' tables of ``seq`` in the tier they point into."""
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

    def take_copy_orders(self) -> list[tuple[int, int]]:
        """The copy-on-write (src, dst) orders queued since the last call."""
        out, self.copy_orders = self.copy_orders, []
        return out
