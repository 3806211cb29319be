"""The analysis of scripts/profile_served.py on a hand-made trace (the script itself runs
servers and is run by hand; its numbers go to docs/BENCHMARKS.md)."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "profile_served.py"
sys.path.insert(0, str(SCRIPT.parent))
_spec = importlib.util.spec_from_file_location("profile_served", SCRIPT)
prof = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prof)


def _trace():
    # step: (kind, t0, t1, schedule, forward, process, close, prefill_tokens, decodes)
    return [
        ["loop", 0.0, 1.0], ["step", 0.0, 0.9, 0.0, 0.8, 0.05, 0.01, 286, 0],
        ["deliver", 0.95, "cmpl-a-0", 1], ["take", 0.96, "cmpl-a-0", 1],
        ["loop", 1.0, 1.1], ["step", 1.0, 1.08, 0.001, 0.07, 0.005, 0.001, 0, 1],
        ["deliver", 1.09, "cmpl-a-0", 2], ["take", 1.092, "cmpl-a-0", 2],
        ["loop", 1.1, 1.2], ["step", 1.1, 1.18, 0.001, 0.07, 0.005, 0.001, 0, 1],
        ["deliver", 1.19, "cmpl-a-0", 3], ["take", 1.193, "cmpl-a-0", 3],
        ["step", 9.0, 9.5, 0, 0, 0, 0, 0, 1],  # outside the pass: ignored
    ]


def test_breakdown_of_a_hand_made_pass():
    run = {"t0": -0.5, "t1": 1.5, "requests": [
        {"t0": -0.5, "id": "cmpl-a", "recv": [0.97, 1.095, 1.197]}]}
    r = prof.analyse(run, _trace(), [0.06, 0.07, 0.08])
    assert r["req_per_s"] == pytest.approx(0.5)
    assert r["ttft_p50_ms"] == pytest.approx(1470.0)
    assert r["itl_p50_ms"] == pytest.approx(113.5)  # (125 + 102) / 2
    assert (r["steps"], r["prefill_only_steps"], r["mixed_steps"]) == (3, 1, 0)
    assert r["decode_batch"] == 1
    assert r["decode_step_p50_ms"] == pytest.approx(80.0)
    assert r["forward_p50_ms"] == pytest.approx(70.0)
    assert r["outputs_p50_ms"] == pytest.approx(80.0 - 1 - 70 - 5 - 1)
    assert r["loop_overhead_p50_ms"] == pytest.approx(20.0)
    assert r["hop_p50_ms"] == pytest.approx(3.0)  # 10, 2, 3 ms
    assert r["wire_p50_ms"] == pytest.approx(4.0)  # 10, 3, 4 ms
    assert r["offline_decode_step_p50_ms"] == pytest.approx(70.0)


def test_table_has_every_row_and_column():
    per = {"before": [dict.fromkeys([k for k, _ in prof.ROWS], 1.5)],
           "after": [dict.fromkeys([k for k, _ in prof.ROWS], 2.0)]}
    table = prof.format_table(per).splitlines()
    assert len(table) == 2 + len(prof.ROWS)
    assert all(line.count("|") == 6 for line in table)
