"""The block writes of the per-event apply: every change a handler makes to a tier's
columns goes through these methods, which journal it first (``state_journal``).

Invariants each write keeps, given the checks its callers make before calling:
- the ref-count path (``_add_refs``) changes a block's ref count by one per id, and keeps
  the display-only owner column in step: a block taken from ref 0 becomes the taker's,
  a block left at ref 0 has no owner (-1), and a block its owner lets go of while
  others still hold it is ``ORPHAN`` (``KVState.resolve_owners`` finds it a holder);
- a block that ends free (ref 0, no hash) loses its demoted format (back to code 0);
- every written block is ``mark``-ed on its tier and gets the batch's step in
  ``touched_c``.
Each helper takes ids already range-checked (``TierState.check_ids``). Short id lists
(``SMALL_IDS`` or fewer) loop over the ``array.array`` views; longer ones use numpy on the
same memory, with the same result.

A mixin of ``KVState`` (through ``UndoJournal``): it reads ``tiers`` and ``_cur_step``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvscope.engine.events.schema import ProtocolError
from kvscope.engine.events.state_journal import UndoJournal
from kvscope.engine.events.state_store import ORPHAN, SMALL_IDS, SeqState, TierState


class BlockWrites(UndoJournal):
    """Tier lookups, block checks and block writes (see the module docstring)."""

    tiers: dict[str, TierState]
    _cur_step: int

    def _tier(self, name: Any) -> TierState:
        """The tier (or a group's pool) named ``name``; refused when there is none."""
        t = self.tiers.get(name)
        if t is None:
            raise ProtocolError(f"unknown tier {name!r}")
        return t

    def _require_table_tier(self, s: SeqState, t: TierState) -> None:
        """A sequence's table lives in one tier: ``t`` becomes it unless it holds blocks
        of another."""
        if s.block_table and s.tier != t.name:
            raise ProtocolError(f"{s.seq_id}'s table is in tier {s.tier}, not {t.name}")
        s.tier = t.name

    def _add_refs(self, t: TierState, ids: list[int], owner: int, delta: int) -> None:
        """The ref-count path, the only writer of ref counts in the per-event apply:
        ``ref += delta`` (+1: a sequence takes or shares the blocks; -1: it lets them go)
        once per entry of ``ids`` (a repeated id counts each time), the owner column kept
        in step for ``owner``'s sequence, every block touched now.

        +1: a block that was at ref 0 becomes ``owner``'s (alloc and the other takers
        check first that their blocks are free and distinct, so for them this is "ref 0
        to 1, owned"). -1: a block left at ref 0 has no owner; one ``owner`` lets go of
        while others still hold it becomes ``ORPHAN``; a block left free (ref 0, no hash)
        loses its demoted format. The callers check what the event may do before this
        runs: nothing here refuses."""
        t.mark(ids)
        self._save3(t.ref_c, t.owner_c, t.touched_c, ids)
        step = self._cur_step
        if len(ids) <= SMALL_IDS:
            ref, own, tch = t.ref_c.py, t.owner_c.py, t.touched_c.py
            for b in ids:
                r = ref[b] + delta
                ref[b] = r
                if delta > 0:
                    if r == 1:
                        own[b] = owner
                elif r == 0:
                    own[b] = -1
                elif own[b] == owner:
                    own[b] = ORPHAN
                tch[b] = step
        else:
            idx = self._idx(ids)
            ref, own = t.ref_c.np, t.owner_c.np
            was_free = ref[idx] == 0 if delta > 0 else None
            # unbuffered: a repeated id counts each time. The delta in the column's own
            # dtype: a Python int sends np.add.at down its slow casting loop (~40x: 130 us
            # for 1,024 ids, against 3)
            np.add.at(ref, idx, ref.dtype.type(delta))
            if was_free is not None:
                own[idx[was_free]] = owner
            else:
                left = ref[idx]
                own[idx[(left > 0) & (own[idx] == owner)]] = ORPHAN
                own[idx[left == 0]] = -1
            t.touched_c.np[idx] = step
        if delta < 0:
            self._drop_formats(t, ids)

    def _drop_formats(self, t: TierState, ids: list[int]) -> None:
        """Blocks that became free (ref 0, no hash) lose their page, hence a demoted
        format: they revert to the tier's (format code 0)."""
        if len(t.format_names) < 2:  # no block of this tier was ever quantized
            return
        ref, hashed, fc = t.ref_c.py, t.hashed_c.py, t.fmt_c.py
        freed = [b for b in ids if fc[b] and not ref[b] and not hashed[b]]
        if freed:
            self._save(t.fmt_c, freed)
            for b in freed:
                fc[b] = 0

    def _set_hashes(self, t: TierState, ids: list[int], hashes: list[Any]) -> None:
        t.mark(ids)
        self._save3(t.hashed_c, t.hash_c, t.touched_c, ids)
        step = self._cur_step
        if not t.big_hashes:  # the common case: every hash fits int64
            try:
                if len(ids) <= SMALL_IDS:
                    hv, hs, tch = t.hash_c.py, t.hashed_c.py, t.touched_c.py
                    for b, h in zip(ids, hashes, strict=True):
                        hv[b] = h  # array('q') raises OverflowError beyond int64
                        hs[b] = 1
                        tch[b] = step
                else:
                    idx = self._idx(ids)
                    t.hash_c.np[idx] = np.array(hashes, dtype=np.int64)
                    t.hashed_c.np[idx] = 1
                    t.touched_c.np[idx] = step
                return
            except OverflowError:
                pass
        self._save_big_hashes(t)
        tch = t.touched_c.py
        for b, h in zip(ids, hashes, strict=True):
            t.set_hash(b, h)
            tch[b] = step

    def _free_blocks(self, t: TierState, ids: list[int], what: str) -> None:
        """Raise unless every id is free (ref 0, no hash) and none repeats."""
        if len(ids) > SMALL_IDS:
            idx = self._idx(ids)
            bad = np.flatnonzero(t.ref_c.np[idx] | t.hashed_c.np[idx])
            if bad.size:
                raise ProtocolError(f"{what}: {t.name} block {ids[bad[0]]} is not free")
        else:
            ref, hashed = t.ref_c.py, t.hashed_c.py
            for b in ids:
                if ref[b] or hashed[b]:
                    raise ProtocolError(f"{what}: {t.name} block {b} is not free")
        if len(ids) > 1 and len(set(ids)) != len(ids):
            raise ProtocolError(f"{what}: duplicate block ids")

