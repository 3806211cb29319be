"""Exports of a LifecycleIndex: Chrome trace-event JSON (opens in ui.perfetto.dev and
chrome://tracing, next to a torch profiler trace) and CSV tables.

Trace layout: process 1 "kvscope requests" has one thread (track) per sequence, in
arrival order, with one complete slice ("X") per lifecycle phase, an instant event ("i")
per preemption carrying its cause, and a flow arrow ("s" -> "f") from the sequence whose
allocation forced the preemption to its victim; process 2 "kvscope cache" holds the counter
tracks ("C"): blocks per tier, prefix hit rate, running/waiting/swapped, recompute share,
token vs block occupancy. Timestamps are unix-epoch microseconds (the engine's wall
clock), so traces of the same run from other tools line up.

Torch-free.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from kvscope.engine.events.analysis.lifecycle import STEP_COLUMNS, LifecycleIndex
from kvscope.engine.events.causes import describe

REQUESTS_PID, CACHE_PID = 1, 2
COUNTER_TRACKS = ("blocks", "hit rate", "sequences", "recompute share", "occupancy")
REQUEST_COLUMNS = (
    "seq", "request", "parent", "priority", "prompt_tokens", "output_tokens", "add_step",
    "first_token_step", "finish_step", "finish_reason", "ttft_s", "tpot_s", "preemptions",
    "prefill_tokens", "recomputed_tokens", "hit_tokens",
)


def _us(t: float) -> float:
    return round(t * 1e6, 1)


def trace_events(idx: LifecycleIndex) -> list[dict[str, Any]]:
    """The trace-event list (see the module docstring for its layout)."""
    st = idx.steps
    end_time = float(st["time"][-1]) if len(st["time"]) else 0.0
    out: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": REQUESTS_PID, "tid": 0,
         "args": {"name": "kvscope requests"}},
        {"ph": "M", "name": "process_name", "pid": CACHE_PID, "tid": 0,
         "args": {"name": "kvscope cache"}},
    ]
    tids = {sid: tid for tid, sid in enumerate(idx.order, start=1)}
    flow = 0
    for tid, sid in enumerate(idx.order, start=1):
        s = idx.seqs[sid]
        out.append({"ph": "M", "name": "thread_name", "pid": REQUESTS_PID, "tid": tid,
                    "args": {"name": sid}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": REQUESTS_PID, "tid": tid,
                    "args": {"sort_index": tid}})
        for ph in s.phases:
            t1 = ph.end_time if ph.end_time is not None else end_time
            args: dict[str, Any] = {"start_step": ph.start_step, "end_step": ph.end_step}
            if ph.detail:
                args["cause"] = ph.detail
            out.append({"ph": "X", "name": ph.kind, "cat": "lifecycle", "pid": REQUESTS_PID,
                        "tid": tid, "ts": _us(ph.start_time),
                        "dur": max(0.0, _us(t1) - _us(ph.start_time)), "args": args})
        for p in s.preemptions:
            needer = (p.cause or {}).get("needed_by")
            if needer in tids and needer != sid:  # an arrow from who needed the blocks
                flow += 1
                common = {"name": "preempted", "cat": "preemption", "pid": REQUESTS_PID,
                          "id": flow, "ts": _us(p.time)}
                out.append({"ph": "s", "tid": tids[needer], **common})
                out.append({"ph": "f", "bp": "e", "tid": tid, **common})
            out.append({"ph": "i", "s": "t", "name": f"preempt ({p.mode})",
                        "cat": "preemption", "pid": REQUESTS_PID, "tid": tid,
                        "ts": _us(p.time), "args": {"step": p.step,
                                                    "cause": describe(p.cause, victim=sid),
                                                    **(p.cause or {})}})
    cum_pre, cum_redo = np.cumsum(st["prefill_tokens"]), np.cumsum(st["recomputed_tokens"])
    for i in range(len(st["step"])):
        ts = _us(float(st["time"][i]))
        hit, query = int(st["hit_tokens"][i]), int(st["query_tokens"][i])
        prev_hit = int(st["hit_tokens"][i - 1]) if i else 0
        prev_query = int(st["query_tokens"][i - 1]) if i else 0
        dq = query - prev_query
        pre, redo = int(cum_pre[i]), int(cum_redo[i])
        slots = int(st["occupied_slots"][i])
        rows = {
            "blocks": {"gpu": max(0, int(st["gpu_used"][i])),
                       "cpu": max(0, int(st["cpu_used"][i]))},
            "hit rate": {"step": (hit - prev_hit) / dq if dq > 0 and hit >= 0 else 0.0,
                         "cumulative": hit / query if query > 0 and hit >= 0 else 0.0},
            "sequences": {"running": int(st["running"][i]), "waiting": int(st["waiting"][i]),
                          "swapped": int(st["swapped"][i])},
            "recompute share": {"cumulative": redo / pre if pre else 0.0},
            "occupancy": {"token_level": int(st["occupied_tokens"][i]), "block_level": slots},
        }
        for name, args in rows.items():
            out.append({"ph": "C", "name": name, "pid": CACHE_PID, "tid": 0, "ts": ts,
                        "args": args})
    return out


def write_perfetto(idx: LifecycleIndex, path: str | os.PathLike,
                   metadata: dict[str, Any] | None = None) -> int:
    """Write a Chrome trace-event JSON file; returns the number of events."""
    events = trace_events(idx)
    doc = {"traceEvents": events, "displayTimeUnit": "ms",
           "otherData": {"producer": "kvscope export", **(metadata or {})}}
    Path(path).write_text(json.dumps(doc, default=_plain))
    return len(events)


def request_rows(idx: LifecycleIndex) -> list[dict[str, Any]]:
    rows = []
    for sid in idx.order:
        s = idx.seqs[sid]
        rows.append({
            "seq": sid, "request": s.request_id, "parent": s.parent or "",
            "priority": s.priority, "prompt_tokens": s.prompt_tokens,
            "output_tokens": s.output_tokens, "add_step": s.add_step,
            "first_token_step": _blank(s.first_token_step), "finish_step": _blank(s.finish_step),
            "finish_reason": s.finish_reason or "", "ttft_s": _blank(s.ttft),
            "tpot_s": _blank(s.tpot), "preemptions": len(s.preemptions),
            "prefill_tokens": s.prefill_tokens, "recomputed_tokens": s.recomputed_tokens,
            "hit_tokens": s.hit_tokens,
        })
    return rows


def write_csv(idx: LifecycleIndex, directory: str | os.PathLike) -> tuple[Path, Path]:
    """``steps.csv`` (one row per step, STEP_COLUMNS) and ``requests.csv`` (one row per
    sequence, REQUEST_COLUMNS) in ``directory`` (created if missing)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    steps, reqs = d / "steps.csv", d / "requests.csv"
    st = idx.steps
    with steps.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(STEP_COLUMNS)
        cols = [st[c].tolist() for c in STEP_COLUMNS]
        w.writerows(zip(*cols, strict=True))
    with reqs.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=REQUEST_COLUMNS)
        w.writeheader()
        w.writerows(request_rows(idx))
    return steps, reqs


def _blank(v: Any) -> Any:
    return "" if v is None else v


def _plain(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, (set, tuple)):
        return list(v)
    raise TypeError(f"not JSON-serialisable: {type(v).__name__}")
