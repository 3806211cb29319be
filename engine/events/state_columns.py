"""The columnar apply: ``KVState.apply`` of a batch in columns (``StepColumns``), with
array operations. A second implementation of the reference (the per-event handlers in
``engine.events.state_handlers``), held equal to it by tests/events/test_columns.py.

How it keeps the reference's meaning:
- Order. The step is cut into runs: a run of hot events (the columns' kinds) or one
  other event, applied in the step's order; an other event goes through the reference
  handler, in the same transaction (one undo log for the whole batch).
- Within a hot run, a block may change in several events (evicted, then allocated), and
  each event's checks and effects depend on the ones before it. So a run is cut again
  into *conflict-free* sub-runs, where no (tier, block) appears in two events: there,
  every event sees its blocks as they were at the sub-run's start, so the effects
  commute and each column is written once with numpy. Sequence bookkeeping (tables,
  counts) is per event, in order.
- Errors. The fast path never writes its own error: at the first thing it does not
  accept (a check that fails, an unusual case it does not handle), it rolls the batch
  back and hands the whole batch, as events, to the reference, which then applies it or
  raises the reference's error. So it may refuse more than it must, never less.

Friend of KVState: it uses the undo log and the column helpers' conventions directly.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvscope.engine.events import columns as C
from kvscope.engine.events import schema as S

# KVState and TierState (engine.events.state, which imports this module): typed Any here
KVState = TierState = Any


class _Refuse(Exception):  # noqa: N818 - internal signal, not an error to anyone
    """The fast path leaves this batch to the reference."""


_HOT_NAMES = ("",) + C.HOT_KINDS  # kind code -> wire name
# a hot run with fewer ids than this goes through the reference handlers: the array
# path pays ~40 numpy calls per run, more than scalar code spends on a few blocks
SMALL_RUN = 256
# ... and a batch whose hot events hold fewer ids than this on average: measured (the
# realistic mix of `scripts/bench_events.py`, 1-4 blocks an event, steps of 17-1,000
# events) its sub-runs are a few events long and the array path costs ~1.5x the reference
BULK_IDS = 32
# other kinds whose handlers read and write only sequence state (never a block column,
# and a block table only through the in-order per-event loop): they join a hot run and
# are applied in their place by the reference handler
SEQ_ONLY = frozenset({S.SEQ_ADD, S.SEQ_START, S.SEQ_PREEMPT, S.SEQ_RESUME, S.SEQ_FINISH})


def worth_arrays(num_events: int, num_ids: int) -> bool:
    """Whether a step of ``num_events`` hot events holding ``num_ids`` block ids goes on
    the array path (the wire writes such a step as columns, any other as events)."""
    return num_ids >= SMALL_RUN and num_ids >= BULK_IDS * num_events


def apply_columns(st: KVState, batch: dict[str, Any], cols: C.StepColumns) -> None:
    """Apply ``cols`` (the batch's events) to ``st``; same result as the reference."""
    st._begin_step(batch)
    try:
        _apply(st, cols)
    except Exception:  # noqa: BLE001 - any refusal or failure: the reference decides
        st._rollback()
        st.columns_refused += 1
        st.apply({k: v for k, v in batch.items() if k != "columns"}
                 | {"events": cols.to_events()})
        return
    st._commit(batch)


def _apply(st: KVState, cols: C.StepColumns) -> None:
    kind = cols.kind
    n = len(kind)
    if not n:
        return
    if not worth_arrays(n - len(cols.others), len(cols.ids)):
        # few ids, or many small events (which overlap: a step frees and reallocates
        # blocks, cutting runs into sub-runs too small for arrays): the reference
        st._apply_events(cols.to_events())
        return
    # a barrier: an other event that is not sequence-only (it may read or write block
    # columns, which a sub-run writes only at its end); everything between barriers is
    # one run
    barrier = kind == C.OTHER
    if barrier.any():
        barrier[barrier] = [type(ev) is not dict or ev.get("kind") not in SEQ_ONLY
                            for ev in cols.others]
    cuts = (np.flatnonzero(barrier[1:] != barrier[:-1]) + 1).tolist()
    run = _Run(cols)
    for a, b in zip([0, *cuts], [*cuts, n], strict=True):
        if barrier[a]:
            st._apply_events(run.rows.events(a, b))
        else:
            run.apply(st, a, b)


class _Run:
    """Per-batch views of the columns a hot run reads."""

    def __init__(self, cols: C.StepColumns) -> None:
        self.cols = cols
        self.rows = rows = C.Rows(cols)
        self.kinds, self.seqs, self.tiers = rows.kinds, rows.seqs, rows.tiers
        self.args, self.off = rows.args, rows.off
        self._pos: tuple[np.ndarray, np.ndarray] | None = None

    def positions(self) -> tuple[np.ndarray, np.ndarray]:
        """Per id position: its entry, and (store, seq_tokens) its index into vals.
        Built on first use (only runs on the array path need them)."""
        if self._pos is None:
            cols = self.cols
            lens = np.diff(cols.off)
            valued = np.repeat(cols.valued(), lens)
            self._pos = (np.repeat(np.arange(len(cols.kind)), lens), np.cumsum(valued) - 1)
        return self._pos

    def apply(self, st: KVState, a: int, b: int) -> None:
        if self.off[b] - self.off[a] < SMALL_RUN:
            # numpy's cost per call exceeds the work: the reference handlers, as events
            st._apply_events(self.rows.events(a, b))
            return
        off, small = self.off, a  # [small, p): sub-runs too small for arrays, pending
        for p, q in self._subruns(a, b):
            if off[q] - off[p] < SMALL_RUN:
                continue
            if small < p:
                st._apply_events(self.rows.events(small, p))
            self._apply_subrun(st, p, q)
            self._count(st, p, q)
            small = q
        if small < b:
            st._apply_events(self.rows.events(small, b))

    def _count(self, st: KVState, p: int, q: int) -> None:
        """Count an array sub-run's hot events (its others counted themselves)."""
        counts = st.kind_counts
        for code, c in enumerate(np.bincount(self.cols.kind[p:q]).tolist()):
            if c and code != C.OTHER:
                name = _HOT_NAMES[code]
                counts[name] = counts.get(name, 0) + c

    def _subruns(self, a: int, b: int) -> list[tuple[int, int]]:
        """[a, b) cut where an event touches a (tier, block) an earlier event of the
        same sub-run touched."""
        cols, off = self.cols, self.off
        lo, hi = off[a], off[b]
        ev = self.positions()[0][lo:hi]
        blocky = cols.kind[ev] != C.SEQ_TOKENS
        ev = ev[blocky]
        if ev.size < 2:
            return [(a, b)]
        key = (cols.tier[ev].astype(np.int64) << 32) | cols.ids[lo:hi][blocky].astype(
            np.int64) & 0xFFFFFFFF
        order = np.lexsort((ev, key))
        key, ev = key[order], ev[order]
        same_key = key[1:] == key[:-1]
        # an earlier *other* event touched this block: the run must start after it
        clash = same_key & (ev[1:] != ev[:-1])
        if not clash.any():
            return [(a, b)]
        # a block repeated inside one event (a hit of the same block twice) is no clash,
        # but the previous *distinct* event then lies further back: carry it forward
        prev = np.where(same_key, ev[:-1], -1)
        for i in np.flatnonzero(same_key & ~clash).tolist():  # rare: repeats in one event
            prev[i] = prev[i - 1] if i and same_key[i - 1] else -1
        lim = np.full(b - a, -1, dtype=np.int64)
        np.maximum.at(lim, ev[1:] - a, prev)
        out, start = [], a
        for e in (np.flatnonzero(lim >= a) + a).tolist():
            if lim[e - a] >= start:
                out.append((start, e))
                start = e
        out.append((start, b))
        return out

    def _apply_subrun(self, st: KVState, p: int, q: int) -> None:
        cols, kinds, off = self.cols, self.kinds, self.off
        names, seqs_col, tiers_col, args = cols.names, self.seqs, self.tiers, self.args
        ids, vals = cols.ids, cols.vals
        owners = [0] * (q - p)
        tier_codes: set[int] = set()
        others, ostart = self.cols.others, self.rows.ostart
        for e in range(p, q):
            k = kinds[e]
            if k == C.OTHER:  # sequence-only (see SEQ_ONLY), in its place
                st._apply_events([others[ostart[e]]])
                continue
            if k == C.SEQ_TOKENS:
                self._seq_tokens(st, e)
                continue
            tc = tiers_col[e]
            t = st.tiers.get(S.TIERS[tc])
            if t is None:
                raise _Refuse
            tier_codes.add(tc)
            if k == C.ALLOC or k == C.HIT:
                s = st._seq(names[seqs_col[e]])
                st._require_table_tier(s, t)
                s.block_table.extend(ids[off[e]:off[e + 1]].tolist())
                if k == C.HIT:
                    s.hit_tokens += args[e]
                owners[e - p] = s.owner_id
            elif k == C.FREE:
                s = st._seq(names[seqs_col[e]])
                if s.tier != t.name or ids[off[e]:off[e + 1]].tolist() != s.block_table:
                    raise _Refuse
                s.block_table = []
                s.num_tokens = 0
                owners[e - p] = s.owner_id
        lo, hi = off[p], off[q]
        if lo == hi:
            return
        pos_ev, val_idx = self.positions()
        ev = pos_ev[lo:hi]
        k_pos = cols.kind[ev]
        owner_pos = np.asarray(owners, dtype=np.int64)[ev - p]
        t_pos = cols.tier[ev]
        for tc in sorted(tier_codes):
            m = (t_pos == tc) & (k_pos != C.SEQ_TOKENS)
            if m.any():
                _blocks(st, st.tiers[S.TIERS[tc]], ids[lo:hi][m].astype(np.intp),
                        k_pos[m], owner_pos[m], vals, val_idx[lo:hi][m])

    def _seq_tokens(self, st: KVState, e: int) -> None:
        cols, off = self.cols, self.off
        lo, hi = off[e], off[e + 1]
        sids = [cols.names[j] for j in cols.ids[lo:hi].tolist()]
        table = st.seqs
        try:
            objs = [table[sid] for sid in sids]
        except KeyError:
            raise _Refuse from None
        st._batch_dirty.update(sids)
        st._save_tokens(objs)
        v = self.rows.vstart[e]
        counts = cols.vals[v:v + hi - lo].tolist()
        for s, n in zip(objs, counts, strict=True):
            s.num_tokens = n


def _blocks(st: KVState, t: TierState, idx: np.ndarray, kind: np.ndarray,
            owner: np.ndarray, vals: np.ndarray, val_idx: np.ndarray) -> None:
    """One conflict-free sub-run's block changes in tier ``t``: every block here is
    touched by one event (maybe several times within it), so each check reads the
    sub-run's starting state and each column is written once."""
    ORPHAN = st.ORPHAN
    if idx.size and (idx.min() < 0 or idx.max() >= t.num_blocks):
        raise _Refuse
    st._save_columns(t, idx)
    t.mark(idx)
    ref, hashed, hv = t.ref_c.np, t.hashed_c.np, t.hash_c.np
    own, fc, tch = t.owner_c.np, t.fmt_c.np, t.touched_c.np
    ma, mh, mf = kind == C.ALLOC, kind == C.HIT, kind == C.FREE
    ms, me = kind == C.STORE, kind == C.EVICT
    ia, ih, i_f, i_s, i_e = idx[ma], idx[mh], idx[mf], idx[ms], idx[me]
    if ia.size and ((ref[ia] != 0).any() or hashed[ia].any() or _repeats(ia, tch)):
        raise _Refuse
    if ih.size and not hashed[ih].all():
        raise _Refuse
    if i_e.size and ((ref[i_e] != 0).any() or not hashed[i_e].all()):
        raise _Refuse
    if i_s.size and _repeats(i_s, tch):
        raise _Refuse  # a store naming a block twice: left to the reference
    if (i_s.size or i_e.size) and t.big_hashes:
        raise _Refuse
    if ia.size:
        ref[ia] = 1
        own[ia] = owner[ma]
    if ih.size:
        was_free = ref[ih] == 0
        if _repeats(ih, tch):
            np.add.at(ref, ih, 1)
        else:
            ref[ih] += 1
        own[ih[was_free]] = owner[mh][was_free]
    if i_f.size:
        if _repeats(i_f, tch):
            np.add.at(ref, i_f, -1)
        else:
            ref[i_f] -= 1
        left = ref[i_f]
        own[i_f[(left > 0) & (own[i_f] == owner[mf])]] = ORPHAN
        own[i_f[left == 0]] = -1
    if i_s.size:
        hv[i_s] = vals[val_idx[ms]]
        hashed[i_s] = 1
    if i_e.size:
        hashed[i_e] = 0
        hv[i_e] = 0
    tch[idx] = st._cur_step  # (after every _repeats, which scribbles on it)
    if len(t.format_names) > 1 and (i_f.size or i_e.size):
        rel = np.concatenate([i_f, i_e])
        fc[rel[(fc[rel] != 0) & (ref[rel] == 0) & (hashed[rel] == 0)]] = 0





def _repeats(idx: np.ndarray, scratch: np.ndarray) -> bool:
    """Whether ``idx`` names a block twice: each position writes its index into
    ``scratch`` (a column this sub-run overwrites anyway, saved in the undo log), and a
    repeated block keeps only one of them. O(n), no sort or hash."""
    pos = np.arange(idx.size, dtype=scratch.dtype)
    scratch[idx] = pos
    return bool((scratch[idx] != pos).any())
