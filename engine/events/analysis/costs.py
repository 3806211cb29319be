"""Per-step cost series over a LifecycleIndex (events only, numpy): what the operator pays,
step by step, for the main window's timelines.

- ``recompute_share``: prefill tokens computed again after a preemption freed them, as a
  share of all prefill tokens computed so far (cumulative, 0..1).
- ``fragmentation``: slots of the GPU blocks held that hold no token (1 - occupied tokens
  / occupied slots; internal fragmentation, 0..1; NaN while nothing is held).
- ``prefix_saved``: prompt tokens served from the prefix cache as a share of all prompt
  tokens that needed KV (hits / (hits + prefill computed)), cumulative; NaN before any.
- ``decode_ms``: duration of each step that decoded tokens (ms; NaN for the others).
- ``decode_context``: mean context length of the tokens decoded in that step (NaN for
  steps without decode): plotted beside ``decode_ms`` it shows latency creep.

Invariant: every series has one entry per batch of the index (``idx.steps["step"]``).
"""

from __future__ import annotations

import numpy as np

from kvscope.engine.events.analysis.lifecycle import LifecycleIndex

COST_SERIES = ("recompute_share", "fragmentation", "prefix_saved", "decode_ms",
               "decode_context")


def cost_series(idx: LifecycleIndex) -> dict[str, np.ndarray]:
    st = idx.steps
    prefill = np.cumsum(st["prefill_tokens"]).astype(np.float64)
    redo = np.cumsum(st["recomputed_tokens"]).astype(np.float64)
    hits = st["hit_tokens"].astype(np.float64)
    hits = np.where(hits >= 0, hits, np.nan)  # -1: the recording has no hit counter
    slots = st["occupied_slots"].astype(np.float64)
    decoded = st["decode_tokens"].astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return {
            "step": st["step"].astype(np.float64),
            "recompute_share": np.where(prefill > 0, redo / np.maximum(prefill, 1), 0.0),
            "fragmentation": np.where(
                slots > 0, 1.0 - st["occupied_tokens"] / np.maximum(slots, 1), np.nan),
            "prefix_saved": np.where(hits + prefill > 0, hits / (hits + prefill), np.nan),
            "decode_ms": np.where(decoded > 0, st["step_time"] * 1000.0, np.nan),
            "decode_context": np.where(
                decoded > 0, st["decode_context_tokens"] / np.maximum(decoded, 1), np.nan),
        }
