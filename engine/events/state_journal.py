"""The undo journal of ``KVState.apply``: how a batch that turns out impossible is
rolled back, leaving the state exactly as it was before the batch.

Contract with the writers (the handlers, the block writes, the columnar apply):
- every mutation inside a batch is journaled *before* it happens: the old values a
  column holds at the ids about to change (``_save``/``_save3``/``_save_columns``), a
  sequence's fields the first time the batch touches it (``_seq``), a dict entry about
  to appear or disappear (``_save_item``), a list entry about to be overwritten
  (``_save_entry``), a tier's big hashes or format names about to change;
- a block table is only appended to in place, replaced by a new list, or overwritten
  at an index journaled with ``_save_entry``; a sequence's ``group_tables`` dict and its
  lists are always replaced, never mutated (so the saved fields restore them);
- ``_rollback`` replays the journal backwards, restoring objects in place, so entries
  journaled in any order compose, and a value journaled twice ends at its oldest.
Cost: in proportion to what the batch touches, never to the cache's size.

A mixin of ``KVState``: it reads and restores ``seqs``, ``kind_counts`` and
``unknown_kinds``, and owns the per-batch fields set by ``_begin``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvscope.engine.events.schema import ProtocolError
from kvscope.engine.events.state_store import SMALL_IDS, Column, SeqState, TierState

_MISSING = object()  # undo-log marker: "this key did not exist"
# undo entries
_COL, _COL3, _ITEM, _SEQ, _TOKENS, _BIG, _FORMATS, _ENTRY = (
    "col", "col3", "item", "seq", "tokens", "big", "formats", "entry")


class UndoJournal:
    """The journal's entries and rollback (see the module docstring)."""

    # KVState's fields the journal reads and restores (set by KVState.__init__)
    seqs: dict[str, SeqState]
    kind_counts: dict[str, int]
    unknown_kinds: int
    _undo: list[tuple] | None  # a list only while a batch is applied
    _idx_key: list[int] | None
    _idx_val: np.ndarray | None

    def _begin(self) -> None:
        self._undo = []
        self._idx_key = self._idx_val = None
        self._touched: set[str] = set()
        self._batch_dirty: set[str] = set()  # also changed by this batch (for clone)
        self._seq_order: list[str] | None = None  # saved before the first seq_finish
        self._saved_counts = (dict(self.kind_counts), self.unknown_kinds)

    def _save(self, col: Column, ids: list[int]) -> None:
        """Log ``col``'s values at ``ids`` (what this batch is about to overwrite)."""
        if len(ids) <= SMALL_IDS:
            py = col.py
            self._undo.append((_COL, col, ids, [py[b] for b in ids]))
        else:
            idx = self._idx(ids)
            self._undo.append((_COL, col, idx, col.np[idx]))  # fancy indexing copies

    def _save3(self, c0: Column, c1: Column, c2: Column, ids: list[int]) -> None:
        """``_save`` of three columns in one undo entry (every block change touches three:
        ref/owner/last change, or hash presence/value/last change)."""
        if len(ids) == 1:  # most block events: no list comprehension (a frame) for one
            p0, p1, p2 = c0.py, c1.py, c2.py
            b = ids[0]
            self._undo.append((_COL3, (p0, p1, p2), ids, [(p0[b], p1[b], p2[b])]))
        elif len(ids) <= SMALL_IDS:
            p0, p1, p2 = c0.py, c1.py, c2.py
            self._undo.append((_COL3, (p0, p1, p2), ids, [(p0[b], p1[b], p2[b]) for b in ids]))
        else:
            for col in (c0, c1, c2):
                self._save(col, ids)

    def _save_columns(self, t: TierState, idx: np.ndarray) -> None:
        """Log every column of ``t`` at ``idx`` (the columnar apply's sub-runs)."""
        for col in t.columns():
            self._undo.append((_COL, col, idx, col.np[idx]))

    def _save_tokens(self, objs: list[SeqState]) -> None:
        """Log the token counts of ``objs`` (one entry for a whole seq_tokens event)."""
        self._undo.append((_TOKENS, objs, None, [s.num_tokens for s in objs]))

    def _idx(self, ids: list[int]) -> np.ndarray:
        """``ids`` as an int64 array, converted once per id list (large events only)."""
        if self._idx_key is not ids:
            self._idx_key, self._idx_val = ids, np.asarray(ids, dtype=np.int64)
        return self._idx_val

    def _save_item(self, d: dict, key: Any) -> None:
        self._undo.append((_ITEM, d, key, d.get(key, _MISSING)))

    def _save_big_hashes(self, t: TierState) -> None:
        self._undo.append((_BIG, t, None, dict(t.big_hashes)))

    def _save_formats(self, t: TierState) -> None:
        """Log ``t``'s format names (a new one is about to be appended)."""
        self._undo.append((_FORMATS, t, None, list(t.format_names)))

    def _save_entry(self, table: list[int], i: int) -> None:
        """Log ``table[i]``, about to be overwritten in place (cow's block tables)."""
        self._undo.append((_ENTRY, table, i, table[i]))

    def _rollback(self) -> None:
        undo, self._undo = self._undo or [], None
        for op, target, key, old in reversed(undo):
            if op is _COL:
                if isinstance(key, np.ndarray):
                    target.np[key] = old  # repeated ids saved the same old value
                else:
                    py = target.py
                    for b, v in zip(key, old, strict=True):
                        py[b] = v
            elif op is _COL3:
                p0, p1, p2 = target
                for b, (v0, v1, v2) in zip(key, old, strict=True):
                    p0[b], p1[b], p2[b] = v0, v1, v2
            elif op is _ITEM:
                if old is _MISSING:
                    target.pop(key, None)
                else:
                    target[key] = old
            elif op is _SEQ:
                fields, table_len = old
                target.__dict__.update(fields)
                del fields["block_table"][table_len:]  # undo in-place appends
            elif op is _ENTRY:
                target[key] = old
            elif op is _TOKENS:
                for seq, n in zip(target, old, strict=True):
                    seq.num_tokens = n
            elif op is _BIG:
                target.big_hashes = old
            else:  # _FORMATS
                target.format_names[:] = old
        if self._seq_order is not None:  # re-inserted sequences go back to their place
            self.seqs = {sid: self.seqs[sid] for sid in self._seq_order if sid in self.seqs}
        self.kind_counts, self.unknown_kinds = self._saved_counts

    def _seq(self, sid: Any) -> SeqState:
        """The sequence, saved to the undo log the first time this batch touches it."""
        s = self.seqs.get(sid) if isinstance(sid, str) else None
        if s is None:
            raise ProtocolError(f"unknown sequence {sid!r}")
        if sid not in self._touched:
            self._touched.add(sid)
            # the table object and its length: handlers only append to a table in place
            # or replace it with a new list (cow's in-place writes log _ENTRY), so this
            # restores it without copying it
            self._undo.append((_SEQ, s, None, (s.__dict__.copy(), len(s.block_table))))
        return s

    # ------------------------------------------------------- column helpers
    # Each takes ids already range-checked. Small id lists loop over array.array (cheap
