"""Threshold alerts over the lifecycle index's per-step columns: off by default, each
rule configurable (utilization above, prefix hit rate below, evictions per second above).

Rates are measured over a trailing window of steps ending at the step shown, so a
single noisy step does not flash a banner.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvscope.engine.events.analysis.lifecycle import LifecycleIndex


@dataclass
class Thresholds:
    enabled: bool = False
    max_utilization: float = 0.90  # gpu used blocks / total blocks
    min_hit_rate: float = 0.50  # prefix hit tokens / query tokens over the window
    max_evictions_per_s: float = 100.0  # evicted blocks per second over the window
    window_steps: int = 50

    def check(self, idx: LifecycleIndex, step: int) -> list[str]:
        """The alerts that fire at ``step`` (empty when disabled or nothing fires)."""
        if not self.enabled:
            return []
        i = idx.row_of_step(step)
        if i < 0:
            return []
        st = idx.steps
        lo = max(0, i - self.window_steps + 1)
        out = []
        used, total = int(st["gpu_used"][i]), int(st["gpu_total"][i])
        if total > 0 and used / total > self.max_utilization:
            out.append(f"gpu utilization {used / total:.0%} > {self.max_utilization:.0%}")
        hit, query = st["hit_tokens"], st["query_tokens"]
        if query[i] >= 0 and lo > 0:
            dq, dh = int(query[i] - query[lo - 1]), int(hit[i] - hit[lo - 1])
        else:
            dq, dh = int(max(0, query[i])), int(max(0, hit[i]))
        if dq > 0 and dh / dq < self.min_hit_rate:
            out.append(f"prefix hit rate {dh / dq:.0%} < {self.min_hit_rate:.0%} "
                       f"(last {i - lo + 1} steps)")
        secs = float(np.sum(st["step_time"][lo: i + 1]))
        ev = int(np.sum(st["evicted_blocks"][lo: i + 1]))
        if secs > 0 and ev / secs > self.max_evictions_per_s:
            out.append(f"{ev / secs:,.0f} evictions/s > {self.max_evictions_per_s:,.0f}")
        return out
