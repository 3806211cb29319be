"""Questions over a span of steps and between two moments.

``range_summary(index, first, last)``: what happened in steps first..last (inclusive)
from a LifecycleIndex. ``diff_states(a, b)``: what differs between two KVStates (two
steps of one recording, or two recordings with the same tiers): blocks allocated, freed,
cached and uncached per tier, and sequences that came, went or changed. The diff reads
only ``canonical()`` and ``block_codes()``, the mirror's stable reading surface.

Torch-free.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvscope.engine.events.analysis.lifecycle import LifecycleIndex
from kvscope.engine.events.state import KVState


def range_summary(idx: LifecycleIndex, first: int, last: int) -> dict[str, Any]:
    """Totals over the batches with ``first <= step <= last`` (swapped bounds are fine)."""
    first, last = min(first, last), max(first, last)
    st = idx.steps
    steps = st["step"]
    i0, i1 = int(np.searchsorted(steps, first, "left")), int(np.searchsorted(steps, last,
                                                                              "right"))
    sl = slice(i0, i1)

    def total(col: str) -> int:
        return int(st[col][sl].sum())

    def cum_delta(col: str) -> int:
        if i1 <= i0 or st[col][i1 - 1] < 0:
            return 0
        before = int(st[col][i0 - 1]) if i0 > 0 and st[col][i0 - 1] >= 0 else 0
        return int(st[col][i1 - 1]) - before

    hit, query = cum_delta("hit_tokens"), cum_delta("query_tokens")
    prefill, redo = total("prefill_tokens"), total("recomputed_tokens")
    slots, toks = st["occupied_slots"][sl], st["occupied_tokens"][sl]
    busy = slots > 0
    return {
        "first_step": first, "last_step": last, "steps": i1 - i0,
        "seconds": float(st["step_time"][sl].sum()),
        "requests_finished": total("finished"),
        "prefill_tokens": prefill, "decode_tokens": total("decode_tokens"),
        "recomputed_tokens": redo, "recompute_share": redo / prefill if prefill else 0.0,
        "hit_tokens": hit, "query_tokens": query,
        "hit_rate": hit / query if query else None,
        "preemptions": total("preemptions"), "evicted_blocks": total("evicted_blocks"),
        "swap_out_blocks": total("swap_out_blocks"), "swap_in_blocks": total("swap_in_blocks"),
        "peak_gpu_blocks": int(st["gpu_used"][sl].max()) if i1 > i0 else 0,
        "peak_running": int(st["running"][sl].max()) if i1 > i0 else 0,
        "peak_waiting": int(st["waiting"][sl].max()) if i1 > i0 else 0,
        # internal fragmentation: slots of used blocks that hold no token
        "fragmentation": float(1 - toks[busy].sum() / slots[busy].sum()) if busy.any() else 0.0,
    }


def diff_states(a: KVState, b: KVState) -> dict[str, Any]:
    """What changed from ``a`` to ``b``. Per tier present in both: ``allocated`` (ref 0 ->
    > 0), ``freed`` (> 0 -> 0), ``cached`` (gained a hash or changed it), ``uncached``
    (lost its hash or changed it: evicted, or reused), ``changed``/``before``/``after`` (block
    ids whose state code differs, and the codes). Sequences: ``seqs_came``, ``seqs_went``,
    ``seqs_changed`` ({seq: (blocks before, blocks after)} where the table differs)."""
    ca, cb = a.canonical(), b.canonical()
    tiers: dict[str, Any] = {}
    for name in sorted(set(ca["tiers"]) & set(cb["tiers"])):
        ta, tb = ca["tiers"][name], cb["tiers"][name]
        if ta["num_blocks"] != tb["num_blocks"]:
            continue  # different pools: nothing block-by-block to compare
        ra, rb = np.asarray(ta["ref"]), np.asarray(tb["ref"])
        ha, hb = ta["hash"], tb["hash"]
        diff_hash = [i for i, (x, y) in enumerate(zip(ha, hb, strict=True)) if x != y]
        codes_a, codes_b = a.block_codes(name), b.block_codes(name)
        changed = np.flatnonzero(codes_a != codes_b)
        tiers[name] = {
            "allocated": np.flatnonzero((ra == 0) & (rb > 0)).tolist(),
            "freed": np.flatnonzero((ra > 0) & (rb == 0)).tolist(),
            "cached": [i for i in diff_hash if hb[i] is not None],
            "uncached": [i for i in diff_hash if ha[i] is not None],
            "changed": changed.tolist(),
            "before": codes_a[changed].tolist(),
            "after": codes_b[changed].tolist(),
        }
    sa, sb = ca["seqs"], cb["seqs"]
    return {
        "from_step": a.step, "to_step": b.step, "tiers": tiers,
        "seqs_came": sorted(set(sb) - set(sa)),
        "seqs_went": sorted(set(sa) - set(sb)),
        "seqs_changed": {sid: (len(sa[sid]["block_table"]), len(sb[sid]["block_table"]))
                         for sid in sorted(set(sa) & set(sb))
                         if sa[sid]["block_table"] != sb[sid]["block_table"]
                         or sa[sid]["tier"] != sb[sid]["tier"]},
    }
