"""vLLM's page table kept current from what a step touched: the per-step read costs what
changed, not the pool (torch-free, vLLM-free; objects duck-typed as in pagetable.py).

``read_page_table`` (pagetable.py) reads every block and every table: the reference, and
O(blocks) per step. ``PageTableTracker`` keeps one ``PageTable`` and, at each step
boundary, re-reads only:

- the blocks in ``Touched``: the plugin's wrappers of vLLM's ``BlockPool`` methods that
  change a block's ref count or hash (get_new_blocks, touch, free_blocks, unpin_blocks,
  _insert_block_hash, _remove_cached_block_hashes) add the block ids they were handed;
  ``reset_prefix_cache`` sets ``all``;
- the tables of sequences whose ``req_to_blocks`` list is another object, changed length,
  has a different last block, or whose first non-null block turned null (a sliding
  window drops blocks from the front, in place): O(1) per sequence. A grown table is the
  old one plus the new blocks; an unchanged one is handed on as the same list object,
  which ``PageTableDiffer.step`` skips;
- requests' status and token counts, deferred frees and the entries of finished
  requests vLLM still holds: O(requests).

Lists it has handed out are never mutated (a changed table is a new list); ``ref`` and
``keys`` are mutated in place (the differ keeps its own). Refs that no table explains
(every block's count is summed incrementally) make it fall back to the full read.

``IncrementalReader`` is what the plugin calls: the tracker each step, the full read at
the first step, after a reset or a fall-back, and every ``check_every`` steps as a check:
a mismatch between the two is counted, logged once per check with the count, and the
tracker resyncs from the full read (the step's events are then diffed from it).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

from kvscope.engine.events.vllm.pagetable import (
    RESERVED,
    PageTable,
    SeqView,
    group_seq_id,
    read_page_table,
)

log = logging.getLogger("kvscope.vllm")

CHECK_EVERY = 1000  # steps between two full reads that check the tracker


@dataclass
class Touched:
    """What vLLM's BlockPool was asked to change since the last step boundary."""

    ids: set[int] = field(default_factory=set)
    all: bool = False  # every block (a prefix-cache reset)

    def clear(self) -> None:
        self.ids.clear()
        self.all = False


@dataclass
class _Row:
    """What the tracker knows of one sequence's ``req_to_blocks`` list."""

    raw: Any  # vLLM's list object
    n: int  # its length when read
    first: int  # index of its first non-null block (n when none)
    last: Any  # its last block object (None when empty)
    table: list[int]  # the non-null block ids (never mutated once handed out)


class PageTableTracker:
    """One engine core's page table, updated from what each step touched (module doc)."""

    def __init__(self, running_status: Any) -> None:
        self.running = running_status
        self.pt: PageTable | None = None
        self._rows: dict[str, _Row] = {}
        self._total_ref = 0

    def adopt(self, scheduler: Any, pt: PageTable) -> None:
        """Take ``pt`` (a full read of ``scheduler`` now) as the tracked state."""
        self.pt = PageTable(pt.num_blocks, pt.block_size, list(pt.ref), list(pt.keys),
                            dict(pt.seqs), pt.unexplained)
        self._total_ref = sum(pt.ref)
        self._rows = {}
        for g, mgr in enumerate(scheduler.kv_cache_manager.coordinator.single_type_managers):
            for rid, raw in mgr.req_to_blocks.items():
                sid = group_seq_id(rid, g)
                s = pt.seqs.get(sid)
                if s is not None and sid != RESERVED:
                    self._rows[sid] = _row(raw, s.table)

    def read(self, scheduler: Any, touched: Touched) -> PageTable | None:
        """The page table now, from the last one and ``touched``; None when the tracker
        cannot say it (a reset, refs no table explains): take the full read then."""
        pt = self.pt
        if pt is None or touched.all:
            return None
        kvm = scheduler.kv_cache_manager
        pool = kvm.block_pool
        blocks = pool.blocks
        ref, keys = pt.ref, pt.keys
        null_id = pool.null_block.block_id
        total = self._total_ref
        for b in touched.ids:
            blk = blocks[b]
            r = 1 if b == null_id else blk.ref_cnt
            total += r - ref[b]
            ref[b] = r
            keys[b] = blk._block_hash
        self._total_ref = total
        managers = kvm.coordinator.single_type_managers
        old = pt.seqs
        rows: dict[str, _Row] = {}
        seqs: dict[str, SeqView] = {}
        explained = 0
        live: dict[str, Any] = {}
        running = self.running
        old_rows = self._rows
        view = SeqView
        groups = [(g, mgr.req_to_blocks.get) for g, mgr in enumerate(managers)]
        for rid, r in scheduler.requests.items():  # O(requests), O(1) each when unchanged
            if r.is_finished():
                continue
            live[rid] = r
            status = "running" if r.status == running else "waiting"
            for g, get in groups:
                sid = rid if g == 0 else group_seq_id(rid, g)
                raw = get(rid)
                if raw:
                    row = old_rows.get(sid)
                    if (row is None or row.raw is not raw or row.n != len(raw)
                            or raw[-1] is not row.last
                            or (row.first < row.n and raw[row.first].is_null)):
                        row = self._table(sid, raw)
                    rows[sid] = row
                    table = row.table
                else:
                    prev = old.get(sid)
                    table = prev.table if prev is not None and not prev.table else []
                explained += len(table)
                seqs[sid] = view(status, table, r.num_computed_tokens, r.num_prompt_tokens, r)
        held: list[list[int]] = []
        for mgr in managers:
            for rid, rblocks in mgr.req_to_blocks.items():
                if rid not in live:
                    held.append([b.block_id for b in rblocks if not b.is_null])
        for _, dblocks in getattr(scheduler, "deferred_frees", ()):
            held.append([b.block_id for b in dblocks
                         if not b.is_null and getattr(b, "pool", pool) in (pool, None)])
        reserved = [null_id, *chain.from_iterable(held)]
        prev_reserved = old.get(RESERVED)
        if prev_reserved is not None and prev_reserved.table == reserved:
            reserved = prev_reserved.table
        if explained + len(reserved) != total:
            return None  # refs no table explains: the full read puts them in RESERVED
        seqs[RESERVED] = SeqView("running", reserved, 0)
        self._rows = rows
        pt.seqs = seqs
        return pt

    def _table(self, sid: str, raw: Any) -> _Row:
        row = self._rows.get(sid)
        n = len(raw)
        if row is not None and row.raw is raw and (row.first >= row.n
                                                   or not raw[row.first].is_null):
            if n == row.n and raw[-1] is row.last:
                return row
            if n > row.n and row.n and raw[row.n - 1] is row.last:  # grown at the end
                grown = row.table + [b.block_id for b in raw[row.n:] if not b.is_null]
                first = row.first if row.first < row.n else _first_non_null(raw, row.n)
                return _Row(raw, n, first, raw[-1], grown)
        return _row(raw, None)


def _first_non_null(raw: Any, start: int = 0) -> int:
    for i in range(start, len(raw)):
        if not raw[i].is_null:
            return i
    return len(raw)


def _row(raw: Any, table: list[int] | None) -> _Row:
    if table is None:
        table = [b.block_id for b in raw if not b.is_null]
    return _Row(raw, len(raw), _first_non_null(raw), raw[-1] if len(raw) else None, table)


def differences(a: PageTable, b: PageTable) -> int:
    """How many blocks and sequences differ between two page tables (0: equal)."""
    if a.num_blocks != b.num_blocks:
        return abs(a.num_blocks - b.num_blocks) or 1
    n = sum(1 for x, y, k, m in zip(a.ref, b.ref, a.keys, b.keys, strict=True)
            if x != y or k != m)
    for sid in a.seqs.keys() | b.seqs.keys():
        s, t = a.seqs.get(sid), b.seqs.get(sid)
        if s is None or t is None or (s.status, s.num_tokens, s.table) != (
                t.status, t.num_tokens, t.table):
            n += 1
    return n


class IncrementalReader:
    """The plugin's step-boundary read: the tracker, checked by the full read every
    ``check_every`` steps (module docstring). ``read`` returns the page table and the
    dirty block ids for ``PageTableDiffer.step`` (None: diff every block)."""

    def __init__(self, running_status: Any, check_every: int = CHECK_EVERY) -> None:
        self.running = running_status
        self.tracker = PageTableTracker(running_status)
        self.check_every = check_every
        self.steps = 0
        self.full_reads = 0  # steps that took the full read (first, resets, fall-backs)
        self.checks = 0
        self.mismatches = 0  # checks that found the tracker wrong (then resynced)

    def read(self, scheduler: Any, touched: Touched) -> tuple[PageTable, set[int] | None]:
        self.steps += 1
        pt = self.tracker.read(scheduler, touched)
        dirty = set(touched.ids)
        touched.clear()
        if pt is not None and self.steps % self.check_every == 0:
            self.checks += 1
            full = read_page_table(scheduler, self.running)
            n = differences(pt, full)
            if n:
                self.mismatches += 1
                log.warning("kvscope: the incremental page table differed from vLLM's in %d "
                            "blocks/sequences (mismatch %d in %d checks); resynced from a "
                            "full read", n, self.mismatches, self.checks)
                self.tracker.adopt(scheduler, full)
                return full, None
        if pt is None:
            self.full_reads += 1
            full = read_page_table(scheduler, self.running)
            self.tracker.adopt(scheduler, full)
            return full, None
        return pt, dirty
