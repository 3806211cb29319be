"""Timeline: per-step statistics over a whole run, in growable numpy columns.

It records what each batch *reports* (its ``stats`` map and how many events of each kind
it carries); it never derives cache state. Missing stats read as 0 (NaN for ratios).
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from engine.events import schema as S

COLUMNS = (
    "step", "time", "gpu_used", "gpu_cached", "gpu_free", "cpu_used", "cpu_cached", "cpu_free",
    "running", "waiting", "swapped", "hit_tokens", "query_tokens", "scheduled_tokens",
    "step_time_s", "preemptions", "evictions", "events",
)


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
        stats = batch.get("stats") or {}
        tiers = stats.get("tiers") or {}
        events = batch.get("events") or []
        preempts = sum(1 for e in events if e.get("kind") == S.SEQ_PREEMPT)
        evicted = sum(len(e.get("blocks", ())) for e in events if e.get("kind") == S.EVICT)
        row = {
            "step": batch.get("step", self.n),
            "time": batch.get("time", 0.0),
            "running": stats.get("running", 0),
            "waiting": stats.get("waiting", 0),
            "swapped": stats.get("swapped", 0),
            "hit_tokens": stats.get("hit_tokens", 0),
            "query_tokens": stats.get("query_tokens", 0),
            "scheduled_tokens": stats.get("scheduled_tokens", 0),
            "step_time_s": stats.get("step_time_s", 0.0),
            # Prefer what the events say; stats may be absent in hand-made recordings.
            "preemptions": max(preempts, _num(stats.get("preemptions"))),
            "evictions": max(evicted, _num(stats.get("evictions"))),
            "events": len(events),
        }
        for tier in ("gpu", "cpu"):
            t = tiers.get(tier) or {}
            for key in ("used", "cached", "free"):
                row[f"{tier}_{key}"] = t.get(key, 0)
            if "used" not in t and "total" in t:  # a reporter may give total, free, cached
                row[f"{tier}_used"] = _num(t["total"]) - _num(t.get("free")) - _num(
                    t.get("cached"))
        for i, name in enumerate(COLUMNS):
            self._data[i, self.n] = _num(row[name])
        self.n += 1

    def extend(self, batches: Iterable[dict[str, Any]]) -> None:
        for b in batches:
            self.append(b)

    def truncate_after(self, step: int) -> None:
        """Drop rows past ``step`` (a live source restarted with a new epoch)."""
        self.n = int(np.searchsorted(self.col("step"), step, side="right"))

    def hit_rate(self) -> np.ndarray:
        """Cumulative prefix-cache hit rate: hit tokens / query tokens so far (NaN before any)."""
        q = np.cumsum(self.col("query_tokens"))
        h = np.cumsum(self.col("hit_tokens"))
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
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0


def _fmt(v: float) -> str:
    if np.isnan(v):
        return ""
    return str(int(v)) if float(v).is_integer() else f"{v:.6g}"
