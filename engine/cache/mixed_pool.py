"""MixedBlockPool: a gpu pool whose blocks each have a format (full precision, int8, int4,
or one block-quantized format: kivi4, k8v4, kivi2)
over an arena of frames (kernels.mixed_pages explains the layout). Pure Python.

Block ids stay what the manager, its events and the mirror know (ref counts, hashes,
tables); a block's *page* -- the frame and sub-slot holding its K/V -- is the pool's own
business, and it moves when the block is demoted, while the id does not. So demotion is
the ``quantize`` event alone: the mirror changes the blocks' format and nothing else.

Invariants (check_invariants):
- a block holds a page iff ref > 0 or it is cached (hashed); a free id holds none and
  has the tier's format;
- a frame is free, or holds one full-precision page, or 1..k pages of one quantized
  format (k = ``subs[fmt]``) in distinct sub-slots;
- ``num_blocks`` (ids) = frames * K (K = sub-pages per frame of the smallest format), so
  an id is free whenever a frame is;
- capacity is counted in frames: ``num_free_blocks`` = free frames + frames every page of
  which is evictable (evicting them all would free exactly those), which is what
  ``allocate`` can deliver as fresh full-precision blocks.

Eviction is frame-driven: ``take`` evicts in policy order until enough frames are free
(evicting an int4 page frees a frame only with its last neighbour), emitting one ``evict``.
``page_code(b)`` is what the runner's kernels read: ((frame * K + sub) << 2) | format id.
"""

from __future__ import annotations

from kvscope.engine.cache.block_pool import BlockPool
from kvscope.engine.cache.eviction import EvictionPolicy
from kvscope.engine.events import formats
from kvscope.engine.events import schema as S
from kvscope.engine.events.sink import EventSink

# Format ids of kernels.mixed_pages (torch-free copy): int8/int4 as
# kernels.triton_cache.FORMAT_IDS; 1 = the layout's one block-quantized format
# (kernels.block_quant: per-channel keys over the block).
BLOCK_FORMATS = formats.BLOCK_KV_CACHE_DTYPES  # the registry's (engine.events.formats)
FORMAT_IDS = {"int8": 2, "int4": 3, **{f: 1 for f in BLOCK_FORMATS}}
# Demotion targets, widest first, with their code bits per element, K and V averaged: a
# chain goes to strictly fewer bits.
DEMOTION_BITS = {"int8": 8, "k8v4": 6, "int4": 4, "kivi4": 4, "kivi2": 2}


class MixedBlockPool(BlockPool):
    def __init__(self, tier: str, num_frames: int, subs: dict[str, int], block_size: int,
                 kv_format: str, policy: EvictionPolicy, sink: EventSink) -> None:
        """``subs``: pages per frame of each demotion format (kernels.mixed_pages)."""
        self.subs = dict(subs)
        self.max_subs = max(self.subs.values())
        super().__init__(tier, num_frames * self.max_subs, block_size, kv_format, policy, sink)
        self.num_frames = num_frames
        n = self.num_blocks
        self.fmt: list[str] = [kv_format] * n  # kv_format = full precision
        self.frame_of: list[int] = [-1] * n
        self.sub_of: list[int] = [0] * n
        self.free_frames: list[int] = list(range(num_frames - 1, -1, -1))
        self.frame_fmt: list[str | None] = [None] * num_frames
        self.residents: list[int] = [0] * num_frames
        self.frame_evictable: list[int] = [0] * num_frames
        self.free_subs: list[list[int]] = [[] for _ in range(num_frames)]
        self.open_frames: dict[str, dict[int, None]] = {f: {} for f in self.subs}
        self.num_reclaimable = 0
        self.num_demoted = 0  # blocks ever demoted (a block demoted twice counts twice)
        self.version = 0  # bumped whenever a page code changes (the runner's cache key)

    # ---------------------------------------------------------------- counts
    @property
    def capacity(self) -> int:
        return self.num_frames

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_frames) + self.num_reclaimable

    def page_code(self, b: int) -> int:
        f = self.frame_of[b]
        if f < 0:
            return 0  # no page: never read (a table never holds a free id)
        fid = FORMAT_IDS.get(self.fmt[b], 0)
        return ((f * self.max_subs + self.sub_of[b]) << 2) | fid

    # ------------------------------------------------------------- frame bookkeeping
    def _reclaimable(self, f: int) -> bool:
        r = self.residents[f]
        return r > 0 and self.frame_evictable[f] == r

    def _count_evictable(self, b: int, delta: int) -> None:
        f = self.frame_of[b]
        before = self._reclaimable(f)
        self.frame_evictable[f] += delta
        self.num_reclaimable += self._reclaimable(f) - before

    def _place(self, b: int, f: int, sub: int, fmt: str) -> None:
        before = self._reclaimable(f)
        self.frame_of[b], self.sub_of[b], self.fmt[b] = f, sub, fmt
        self.residents[f] += 1
        self.frame_fmt[f] = fmt
        self.num_reclaimable += self._reclaimable(f) - before
        self.version += 1

    def _unplace(self, b: int) -> None:
        """Take block b's page out of its frame (b must not be counted evictable)."""
        f = self.frame_of[b]
        before = self._reclaimable(f)
        self.residents[f] -= 1
        fmt = self.fmt[b]
        if self.residents[f] == 0:
            self.free_subs[f] = []
            self.frame_fmt[f] = None
            if fmt in self.open_frames:
                self.open_frames[fmt].pop(f, None)
            self.free_frames.append(f)
        elif fmt in self.open_frames:
            self.free_subs[f].append(self.sub_of[b])
            self.open_frames[fmt][f] = None
        self.num_reclaimable += self._reclaimable(f) - before
        self.frame_of[b], self.sub_of[b], self.fmt[b] = -1, 0, self.kv_format
        self.version += 1

    # ------------------------------------------------------------ allocation
    def take(self, n: int) -> list[int]:
        """``n`` fresh full-precision blocks (ids with a frame each); evicts cached blocks in
        policy order until ``n`` frames are free. Caller checked n <= num_free_blocks."""
        if len(self.free_frames) < n:
            self._evict_until(n)
        free = self.free_blocks
        k = len(free)
        blocks = free[k - n:]
        del free[k - n:]
        blocks.reverse()
        for b in blocks:
            self._place(b, self.free_frames.pop(), 0, self.kv_format)
        return blocks

    def _evict_until(self, frames: int) -> None:
        victims = []
        while len(self.free_frames) < frames:
            victims += self._unindex(self.evictable.pop(1))
        self._announce_evicted(victims)

    def _unindex(self, victims: list[int]) -> list[int]:
        entry, cached = self.entry, self.cached
        for b in victims:
            del cached[entry[b][0]]
            entry[b] = None
            self._count_evictable(b, -1)
            self._unplace(b)
            self.free_blocks.append(b)
        return victims

    def _announce_evicted(self, victims: list[int]) -> None:
        if not victims:
            return
        victims.sort()
        self.num_evictions += len(victims)
        if self.sink.enabled:
            self.sink.evict(self.tier, victims, None)

    def evict(self, max_blocks: int | None = None) -> int:
        n = len(self.evictable) if max_blocks is None else min(max_blocks, len(self.evictable))
        victims = self._unindex(self.evictable.pop(n)) if n else []
        self._announce_evicted(list(victims))
        return n

    def _evict(self, n: int) -> list[int]:  # BlockPool's lazy path, unused here
        raise NotImplementedError("MixedBlockPool evicts by frames (take/evict)")

    def release(self, blocks: list[int]) -> None:
        ref, entry = self.ref, self.entry
        cached = []
        for b in reversed(blocks):
            r = ref[b] - 1
            ref[b] = r
            if r == 0:
                if entry[b] is None:
                    self._unplace(b)
                    self.free_blocks.append(b)
                else:
                    cached.append(b)
                    self._count_evictable(b, 1)
        if cached:
            self.evictable.push(cached)

    def share(self, blocks: list[int], priority: int) -> None:
        for b in blocks:
            if self.ref[b] == 0:
                self._count_evictable(b, -1)
        super().share(blocks, priority)

    # -------------------------------------------------------------- demotion
    def demote(self, blocks: list[int], fmt: str) -> list[tuple[int, int]]:
        """Move each block's page into a ``fmt`` sub-slot; returns (old code, new code) per
        block for the runner, whose batched kernel reads every source before writing any
        destination (so a destination may be a frame a source of the same batch leaves).

        Destinations: sub-slots of open ``fmt`` frames first, then -- for a batch of
        full-precision sources -- the frames the batch itself empties (a group of k pages
        packs into the first one's frame), then free frames. Raises ValueError (nothing
        changed) when the batch does not fit, which the planner avoids."""
        if fmt not in self.open_frames:
            raise ValueError(f"demotion format {fmt!r} is not enabled ({list(self.subs)})")
        old = [self.page_code(b) for b in blocks]
        evictable = [self.ref[b] == 0 for b in blocks]
        slots: list[tuple[int, int]] = []
        open_slots = [(f, s) for f in self.open_frames[fmt] for s in self.free_subs[f]]
        k = self.subs[fmt]
        # Frames whose every resident leaves in this batch can take new pages.
        leaving: dict[int, int] = {}
        for b in blocks:
            leaving[self.frame_of[b]] = leaving.get(self.frame_of[b], 0) + 1
        emptied = [f for f, c in leaving.items() if c == self.residents[f]]
        reusable = iter(emptied + self.free_frames[::-1])
        for _ in blocks:
            if not open_slots:
                f = next(reusable, None)
                if f is None:
                    raise ValueError(f"no room to demote {len(blocks)} blocks to {fmt}")
                open_slots = [(f, s) for s in range(k)]
            slots.append(open_slots.pop(0))
        # Apply: take every page out, then place them (a reused frame empties first).
        for b, ev in zip(blocks, evictable, strict=True):
            if ev:
                self._count_evictable(b, -1)
            self._unplace(b)
        used_frames = {f for f, _ in slots}
        for f in used_frames:
            if f in self.free_frames:
                self.free_frames.remove(f)
                self.free_subs[f] = list(range(k))
                self.open_frames[fmt][f] = None
        for b, (f, s), ev in zip(blocks, slots, evictable, strict=True):
            self.free_subs[f].remove(s)
            self._place(b, f, s, fmt)
            if ev:
                self._count_evictable(b, 1)
        for f in used_frames:
            if not self.free_subs[f]:
                self.open_frames[fmt].pop(f, None)
        self.num_demoted += len(blocks)
        if self.sink.enabled and blocks:
            self.sink.emit(S.QUANTIZE, tier=self.tier, blocks=list(blocks), format=fmt)
        return list(zip(old, [self.page_code(b) for b in blocks], strict=True))

    def check_frames(self) -> None:
        """AssertionError unless pages, frames and counters agree (tests)."""
        residents = [0] * self.num_frames
        evictable = [0] * self.num_frames
        seen: set[tuple[int, int]] = set()
        for b in range(self.num_blocks):
            holds = self.ref[b] > 0 or self.entry[b] is not None
            f = self.frame_of[b]
            assert holds == (f >= 0), f"block {b}: page {f} but ref {self.ref[b]}"
            if f < 0:
                assert self.fmt[b] == self.kv_format, f"free block {b} has format {self.fmt[b]}"
                continue
            assert self.frame_fmt[f] == self.fmt[b], f"block {b} in a {self.frame_fmt[f]} frame"
            assert (f, self.sub_of[b]) not in seen, f"two pages in frame {f} sub {self.sub_of[b]}"
            seen.add((f, self.sub_of[b]))
            residents[f] += 1
            evictable[f] += self.ref[b] == 0
            k = self.subs.get(self.fmt[b], 1)
            assert self.sub_of[b] < k, f"block {b} sub {self.sub_of[b]} >= {k}"
        assert residents == self.residents, "resident counts drifted"
        assert evictable == self.frame_evictable, "evictable counts drifted"
        free = set(self.free_frames)
        assert len(free) == len(self.free_frames), "a frame twice on the free stack"
        assert free == {f for f in range(self.num_frames) if residents[f] == 0}
        assert self.num_reclaimable == sum(map(self._reclaimable, range(self.num_frames)))
        for fmt, frames in self.open_frames.items():
            want = {f for f in range(self.num_frames) if self.frame_fmt[f] == fmt
                    and residents[f] < self.subs[fmt]}
            assert set(frames) == want, f"open {fmt} frames {set(frames)} != {want}"
            for f in want:
                subs = {self.sub_of[b] for b in range(self.num_blocks) if self.frame_of[b] == f}
                assert set(self.free_subs[f]) == set(range(self.subs[fmt])) - subs
