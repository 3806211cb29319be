"""WindowGroup: the sliding-window KV cache group of a hybrid cache (pure Python, no tensors).

A model whose layers attend in two ways (Gemma 3: five sliding-window layers per global
one; Mistral: every layer windowed) needs two kinds of block tables. Group 0 is the
cache manager's own table (``CacheSeq.block_table``, over the gpu pool): the full-attention
layers read it. Group 1 is this one: the windowed layers' K/V live in their own pool of
blocks, and a query at position p of a windowed layer reads keys p-W+1..p only, so a
block all of whose positions lie before the window of every query still to come is
released at once.

Why an own pool and not vLLM's one shared pool: vLLM re-lays its KV tensors so that a
page holds the same number of layers in every group; kvscope's pages are per layer
(``[num_blocks, block_size, Hkv, D]``), so the windowed layers get their own, smaller page
tensors and their own block ids (as llama.cpp's separate SWA cache). The price: the split
of a byte budget between the two pools is fixed at start (engine.runner.kv_budget).

Invariants (``check``): ``CacheSeq.window_table`` has one entry per group-0 block;
entries ``< window_first`` are ``RELEASED``, the rest are held blocks of ``pool`` (ref
counts = table entries, forks share). Released: every logical block ``i`` with
``(i + 1) * block_size <= start - W + 1`` where ``start`` is the first position the last
allocation computed (decode steps included), so during decode a sequence holds at most
``ceil(W / block_size) + 1`` window blocks (a prefill chunk of n tokens: about
``(W + n) / block_size + 1``, the blocks it releases reused by its own allocation).

Limits (the cache manager refuses them with a window group): prefix caching (a hit would
need the window group's blocks of the last W prefix tokens, which are not indexed), the
cpu and disk tiers, kv demotion.
"""

from __future__ import annotations

from engine.cache.block_pool import BlockPool
from engine.cache.sequence import CacheSeq
from engine.cache.slots import slot_mapping

RELEASED = -1  # a window-table entry whose block fell out of the window


class WindowGroup:
    def __init__(self, pool: BlockPool, window: int) -> None:
        self.pool, self.window, self.block_size = pool, window, pool.block_size
        self.copy_orders: list[tuple[int, int]] = []  # copy-on-write (src, dst), group 1

    def first_kept(self, start: int) -> int:
        """The first logical block a query at position >= ``start`` can still see."""
        return max(0, (start - self.window + 1) // self.block_size)

    def needed(self, seq: CacheSeq, n: int) -> int:
        """Free window blocks ``allocate(seq, n)`` needs: the new ones, less those the
        same call releases first (blocks only this sequence held); may be negative."""
        if n == 0:
            return 0
        bs, num, table = self.block_size, seq.num_tokens, seq.window_table
        need = -(-(num + n) // bs) - len(table)
        if num % bs and table and self.pool.ref[table[-1]] > 1:
            need += 1  # copy-on-write of the shared partial last block
        ref = self.pool.ref
        first = min(self.first_kept(num), len(table))
        return need - sum(ref[b] == 1 for b in table[seq.window_first:first])

    def allocate(self, seq: CacheSeq, n: int) -> tuple[list[int], list[int], list[int]]:
        """Release what no query from ``num_tokens`` on can see, then take blocks for
        positions [num_tokens, num_tokens + n) (the caller checked ``needed``; a released
        block may be reused at once: no query of this step reads it). Returns (new
        blocks, released blocks, (src, dst) of a copy-on-write or [])."""
        bs, pool, table, start = self.block_size, self.pool, seq.window_table, seq.num_tokens
        released = self._release_before(seq, self.first_kept(start))
        need = -(-(start + n) // bs) - len(table)
        if start % bs and table and pool.ref[table[-1]] > 1:
            need += 1
        blocks = pool.allocate(need) if need > 0 else []
        cow: list[int] = []
        if start % bs and table and pool.ref[table[-1]] > 1:
            src, dst = table[-1], blocks[0]
            blocks = blocks[1:]
            pool.ref[src] -= 1
            table[-1] = dst
            self.copy_orders.append((src, dst))
            cow = [src, dst]
        table += blocks
        return blocks, released, cow

    def _release_before(self, seq: CacheSeq, first: int) -> list[int]:
        table = seq.window_table
        first = min(first, len(table))
        if first <= seq.window_first:
            return []
        out = table[seq.window_first:first]
        self.pool.release(out)
        table[seq.window_first:first] = [RELEASED] * len(out)
        seq.window_first = first
        return out

    def release_before(self, seq: CacheSeq, start: int) -> list[int]:
        """Release the blocks no query at position >= ``start`` can see (decode path)."""
        return self._release_before(seq, self.first_kept(start))

    def release_all(self, seq: CacheSeq) -> list[int]:
        """Drop every held window block of the sequence (free, preempt, finish)."""
        held = seq.window_table[seq.window_first:]
        if held:
            self.pool.release(held)
        seq.window_table = []
        seq.window_first = 0
        return held

    def fork(self, parent: CacheSeq, child: CacheSeq) -> None:
        child.window_table = list(parent.window_table)
        child.window_first = parent.window_first
        self.pool.add_ref(parent.window_table[parent.window_first:])

    def slots(self, seq: CacheSeq, start: int, end: int) -> list[int]:
        """Window-pool slots of positions [start, end) (all held: they are being computed)."""
        return slot_mapping(seq.window_table, self.block_size, start, end)

    def runner_table(self, seq: CacheSeq) -> list[int]:
        """The table the kernels read: released entries point at block 0, whose keys lie
        outside every query's window and are masked (never a wrong read, any valid id)."""
        t = seq.window_table
        return [0] * seq.window_first + t[seq.window_first:]

    def held(self, seq: CacheSeq) -> int:
        return len(seq.window_table) - seq.window_first

    def check(self, seqs: list[CacheSeq]) -> None:
        """Ref counts = held table entries; free blocks hold no reference."""
        n = self.pool.num_blocks
        expected = [0] * n
        for s in seqs:
            t = s.window_table
            if len(t) != len(s.block_table):
                raise AssertionError(f"{s.seq_id}: window table has {len(t)} entries, the "
                                     f"block table {len(s.block_table)}")
            if any(b != RELEASED for b in t[:s.window_first]) or \
                    any(b == RELEASED for b in t[s.window_first:]):
                raise AssertionError(f"{s.seq_id}: window table {t} vs first {s.window_first}")
            for b in t[s.window_first:]:
                expected[b] += 1
        if self.pool.ref != expected:
            raise AssertionError("window group: ref counts != held table entries")
        free = set(self.pool.free_blocks)
        if any((expected[b] == 0) != (b in free) for b in range(n)):
            raise AssertionError("window group: a block is neither free nor held")
