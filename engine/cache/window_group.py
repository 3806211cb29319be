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

Prefix caching (vLLM's SlidingWindowManager rule, kvscope's bookkeeping): a window block
is indexed in this pool's own prefix index under the same chain hash as the group-0 block
of the same logical position, as soon as that block is full and its token ids are known
(``store``); its entry's serial is the group-0 serial of that content, which identifies the
whole verified prefix, so a window hit is exact (a hash collision is a miss, never a wrong
hit). Released hashed blocks stay cached (evictable, this pool's LRU order) until an
allocation of this pool evicts them, or group 0 evicts the same content (the manager's
``_drop_window_twins``: no hit can reach them then).
A prefix of k blocks is a hit (``longest_hit``) when group 0 holds all k and this group
holds the blocks covering its last W tokens, ``first_kept(k * bs - 1) .. k - 1``; the
entries before them are ``RELEASED``. The longest such k is found from the right, each
block looked up once (as vLLM scans for ``cdiv(W - 1, block_size)`` contiguous blocks).

Swap (the manager's ``window_host``, an engine.cache.host_tier.HostTier over ``pool`` and
``host``): the window blocks get their own host pool, not a share of group 0's, for the
reason they have their own gpu pool: a host block is a copy of one gpu page, and a window
page holds the windowed layers only (a group-0 page the others), so one host pool for both
would size every host block for all layers and leave most of each empty. A preempted
sequence moves its held window blocks (released entries stay ``RELEASED``) to ``host``
and back, alongside its group-0 table; while it is swapped (``tier`` "cpu") its held
entries are ``host`` blocks (``pool_of``). The host pool is swap space only: no
write-back and no host hits (a host hit would need the window blocks of the prefix's last
W tokens on the host too), so a copy's index entry there serves only to share a content
swapped out twice.

Limits (the cache manager refuses them with a window group): the disk tier, kv demotion.
"""

from __future__ import annotations

from kvscope.engine.cache.block_pool import BlockPool, Entry
from kvscope.engine.cache.sequence import CacheSeq
from kvscope.engine.cache.slots import slot_mapping

RELEASED = -1  # a window-table entry whose block fell out of the window


class WindowGroup:
    def __init__(self, pool: BlockPool, window: int, host: BlockPool | None = None) -> None:
        self.pool, self.window, self.block_size = pool, window, pool.block_size
        self.host = host  # its own pool on the cpu tier: swap space (see the docstring)
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

    def pool_of(self, seq: CacheSeq) -> BlockPool:
        """The pool the sequence's held window blocks are in: the host's while swapped."""
        return self.host if seq.tier == "cpu" else self.pool

    def release_all(self, seq: CacheSeq) -> list[int]:
        """Drop every held window block of the sequence (free, preempt, finish), in the
        pool of its tier."""
        held = seq.window_table[seq.window_first:]
        if held:
            self.pool_of(seq).release(held)
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

    # ------------------------------------------------------------ prefix cache
    def store(self, seq: CacheSeq, items: list[tuple[int, Entry]]) -> list[int]:
        """Index the held window blocks of logical blocks ``i`` under ``entry`` (the
        group-0 hash and serial of that content), where neither the block nor the hash
        is indexed yet; returns the blocks newly indexed."""
        pool, table, first = self.pool, seq.window_table, seq.window_first
        entry, cached = pool.entry, pool.cached
        stored = []
        for i, e in items:
            if i < first:
                continue  # released before its ids were known: not indexed
            b = table[i]
            if entry[b] is None and e[0] not in cached:
                entry[b] = e
                cached[e[0]] = b
                stored.append(b)
        if stored:
            pool.evictable.touch(stored, seq.priority)
        return stored

    def longest_hit(self, chain: list[tuple[int, int]]) -> tuple[int, list[int]]:
        """The longest prefix of a group-0 hit this group can serve. ``chain``: (hash,
        group-0 serial) of each hit block, in order. Returns (k, window blocks of logical
        blocks ``first_kept(k * bs - 1) .. k - 1``); k = 0: no hit."""
        cached, entry, bs = self.pool.cached, self.pool.entry, self.block_size
        k = len(chain)
        found: dict[int, int] = {}
        while k > 0:
            lo = self.first_kept(k * bs - 1)
            j = k - 1
            while j >= lo:
                h, serial = chain[j]
                b = found.get(j)
                if b is None:
                    b = cached.get(h)
                    if b is None or entry[b][3] != serial:
                        break  # no prefix ending past block j can use a window through j
                    found[j] = b
                j -= 1
            if j < lo:
                return k, [found[i] for i in range(lo, k)]
            k = j
        return 0, []

    def take_hit(self, seq: CacheSeq, k: int, blocks: list[int]) -> None:
        """Share ``longest_hit``'s blocks into the empty table of ``seq``."""
        lo = k - len(blocks)
        self.pool.share(blocks, seq.priority)
        seq.window_table = [RELEASED] * lo + blocks
        seq.window_first = lo

    def evict(self) -> int:
        """Drop every cached free window block from the index (a prefix-cache reset)."""
        return self.pool.evict()

    def held(self, seq: CacheSeq) -> int:
        return len(seq.window_table) - seq.window_first

    def check(self, seqs: list[CacheSeq]) -> None:
        """Per pool (the gpu's; the host's, where swapped sequences hold theirs): ref counts
        = held table entries of the sequences in that tier; a block with no reference is
        free (unhashed) or cached (hashed, evictable); the index and the entries agree; a
        held indexed block holds its own sequence's chain hash and tokens."""
        for s in seqs:
            t = s.window_table
            if len(t) != len(s.block_table):
                raise AssertionError(f"{s.seq_id}: window table has {len(t)} entries, the "
                                     f"block table {len(s.block_table)}")
            if any(b != RELEASED for b in t[:s.window_first]) or \
                    any(b == RELEASED for b in t[s.window_first:]):
                raise AssertionError(f"{s.seq_id}: window table {t} vs first {s.window_first}")
        self._check_pool(self.pool, [s for s in seqs if s.tier != "cpu"])
        if self.host is not None:
            self._check_pool(self.host, [s for s in seqs if s.tier == "cpu"])
        elif any(s.tier == "cpu" for s in seqs):
            raise AssertionError("window group: a swapped sequence without a host pool")

    def _check_pool(self, pool: BlockPool, seqs: list[CacheSeq]) -> None:
        n, entry, bs, name = pool.num_blocks, pool.entry, self.block_size, \
            f"window group ({pool.tier})"
        expected = [0] * n
        for s in seqs:
            for b in s.window_table[s.window_first:]:
                expected[b] += 1
        if pool.ref != expected:
            raise AssertionError(f"{name}: ref counts != held table entries")
        free, cached_free = set(pool.free_blocks), set(pool.evictable)
        if len(free) != len(pool.free_blocks) or free & cached_free:
            raise AssertionError(f"{name}: a block twice on the free stack or both free "
                                 "and cached")
        if any((expected[b] == 0) != (b in free or b in cached_free) for b in range(n)):
            raise AssertionError(f"{name}: a block is neither free, cached nor held")
        if any(entry[b] is not None for b in free) or any(entry[b] is None for b in cached_free):
            raise AssertionError(f"{name}: a free block is hashed or a cached one is not")
        if n - entry.count(None) != len(pool.cached) or any(
                entry[b] is None or entry[b][0] != h for h, b in pool.cached.items()):
            raise AssertionError(f"{name}: the hash index and the entries disagree")
        for s in seqs:
            for i in range(s.window_first, len(s.window_table)):
                e = entry[s.window_table[i]]
                if e is not None and (e[2] != tuple(s.token_ids[i * bs:(i + 1) * bs])
                                      or len(s.token_ids) < (i + 1) * bs):
                    raise AssertionError(f"{s.seq_id}: window block {i} indexed with other "
                                         "tokens")
