"""Timeline: per-step statistics over a whole run, in growable numpy columns.

It records what each batch *reports* (its ``stats``, engine.events.stats.StepStats, and
how many events of each kind it carries); it never derives cache state. Stats a batch
does not report read as 0 (NaN for ratios).
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from kvscope.engine.events import schema as S
from kvscope.engine.events.stats import StepStats

COLUMNS = (
    "step", "time", "gpu_used", "gpu_cached", "gpu_free", "cpu_used", "cpu_cached", "cpu_free",
    "running", "waiting", "swapped", "hit_tokens", "query_tokens", "scheduled_tokens",
    "step_time_s", "preemptions", "evictions", "events", "demotions",
    "disk_used", "disk_cached", "disk_free", "prefetched", "arrived", "missed",
)


_IDX = {name: i for i, name in enumerate(COLUMNS)}
(_STEP, _TIME, _PREEMPT, _EVICT, _EVENTS, _DEMOTE, _RUNNING, _WAITING, _SWAPPED, _HIT,
 _QUERY, _SCHEDULED, _STEP_TIME) = (_IDX[k] for k in (
    "step", "time", "preemptions", "evictions", "events", "demotions", "running", "waiting",
    "swapped", "hit_tokens", "query_tokens", "scheduled_tokens", "step_time_s"))
_TIER_COLS = {t: (_IDX[f"{t}_used"], _IDX[f"{t}_cached"], _IDX[f"{t}_free"])
              for t in ("gpu", "cpu", "disk")}
# disk blocks whose prefetch reads started / arrived intact / missed, per step
_PREFETCHED, _ARRIVED, _MISSED = (_IDX[k] for k in ("prefetched", "arrived", "missed"))


class Timeline:
    """Columns of float64, one row per applied batch, rows in step order."""

    def __init__(self) -> None:
        self._data = np.zeros((len(COLUMNS), 1024), dtype=np.float64)
        self.n = 0

    def __len__(self) -> int:
        return self.n

    def clear(self) -> None:
        self.n = 0

    def col(self, name: str) -> np.ndarray:
        """A read-only view of one column (``COLUMNS``) over the rows so far."""
        v = self._data[COLUMNS.index(name), : self.n]
        v.flags.writeable = False
        return v

    def append(self, batch: dict[str, Any]) -> None:
        if self.n == self._data.shape[1]:
            grown = np.zeros((len(COLUMNS), self._data.shape[1] * 2), dtype=np.float64)
            grown[:, : self.n] = self._data[:, : self.n]
            self._data = grown
        st = StepStats.read(batch.get("stats"))
        events = batch.get("events") or ()
        preempts = evicted = demoted = prefetched = arrived = missed = 0
        for e in events:
            kind = e.get("kind")
            if kind == S.SEQ_PREEMPT:
                preempts += 1
            elif kind == S.EVICT:
                evicted += len(e.get("blocks", ()))
            elif kind == S.QUANTIZE:  # blocks demoted this step
                demoted += len(e.get("blocks", ()))
            elif kind == S.PREFETCH:
                prefetched += len(e.get("src", ()))
            elif kind == S.DISK_LOAD:
                arrived += len(e.get("src", ()))
                missed += int(e.get("missed") or 0)
        col, n = self._data, self.n
        col[_STEP, n] = _num(batch.get("step", n))
        col[_TIME, n] = _num(batch.get("time", 0.0))
        col[_RUNNING, n] = st.running or 0
        col[_WAITING, n] = st.waiting or 0
        col[_SWAPPED, n] = st.swapped or 0
        col[_HIT, n] = st.hit_tokens or 0
        col[_QUERY, n] = st.query_tokens or 0
        col[_SCHEDULED, n] = st.scheduled_tokens or 0
        col[_STEP_TIME, n] = st.step_time_s or 0.0
        # Per-step marks come from the events themselves (the stats' counters are
        # cumulative totals, see engine.events.schema).
        col[_PREEMPT, n] = preempts
        col[_EVICT, n] = evicted
        col[_DEMOTE, n] = demoted
        col[_PREFETCHED, n], col[_ARRIVED, n], col[_MISSED, n] = prefetched, arrived, missed
        col[_EVENTS, n] = len(events)
        for tier, (iu, ic, i_f) in _TIER_COLS.items():
            t = st.tier(tier)
            cached, free = t.cached or 0, t.free or 0
            if t.used is not None:
                used = t.used
            elif t.total is not None:  # a reporter may give total, free and cached only
                used = t.total - free - cached
            else:
                used = 0
            col[iu, n], col[ic, n], col[i_f, n] = used, cached, free
        self.n += 1

    def extend(self, batches: Iterable[dict[str, Any]]) -> None:
        for b in batches:
            self.append(b)

    def truncate_after(self, step: int) -> None:
        """Drop rows past ``step`` (a live source restarted with a new epoch)."""
        self.n = int(np.searchsorted(self.col("step"), step, side="right"))

    def hit_rate(self) -> np.ndarray:
        """Prefix-cache hit rate since the engine started: the stats' hit and query token
        counters are cumulative (NaN before any query)."""
        q = self.col("query_tokens")
        h = self.col("hit_tokens")
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(q > 0, h / np.maximum(q, 1), np.nan)

    def throughput(self) -> np.ndarray:
        """Scheduled tokens per second of step time (falls back to wall-clock step gaps)."""
        tok = self.col("scheduled_tokens")
        dt = self.col("step_time_s").copy()
        gaps = np.diff(self.col("time"), prepend=np.nan)
        dt = np.where(dt > 0, dt, gaps)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(dt > 0, tok / np.where(dt > 0, dt, 1.0), np.nan)

    def index_of_step(self, step: float) -> int:
        """Row whose step is nearest at or before ``step`` (0 if before the first)."""
        i = int(np.searchsorted(self.col("step"), step, side="right")) - 1
        return max(0, min(i, self.n - 1))

    def write_csv(self, path: str | Path) -> None:
        """All columns plus the derived hit rate and throughput, one row per step."""
        derived = {"hit_rate": self.hit_rate(), "throughput_tok_s": self.throughput()}
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow([*COLUMNS, *derived])
            for r in range(self.n):
                vals = [_fmt(self._data[i, r]) for i in range(len(COLUMNS))]
                vals += [_fmt(d[r]) for d in derived.values()]
                w.writerow(vals)


def _num(v: Any) -> float:
    if type(v) is int or type(v) is float:
        return v
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0


def _fmt(v: float) -> str:
    if np.isnan(v):
        return ""
    return str(int(v)) if float(v).is_integer() else f"{v:.6g}"
