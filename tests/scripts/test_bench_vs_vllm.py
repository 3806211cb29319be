"""The pure parts of scripts/bench_vs_vllm.py (no vLLM here: the script itself is run by
hand and its numbers go to docs/BENCHMARKS.md)."""

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.waiting import HANG_S, wait_until

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_vs_vllm.py"
_spec = importlib.util.spec_from_file_location("bench_vs_vllm", SCRIPT)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_equal_threads_give_the_one_count():
    assert bench.check_threads({"vllm": 2, "kvscope": 2}) == 2


def test_different_threads_refuse_to_compare():
    with pytest.raises(bench.ThreadMismatch, match="kvscope=2, vllm=1"):
        bench.check_threads({"vllm": 1, "kvscope": 2})


def test_table_ratio_says_kvscope_better_above_one_for_both_kinds_of_metric():
    rows = [{"dtype": "float32", "workload": "offline-32x64", "metric": "tok_per_s",
             "vllm": [200.0, 232.6], "kvscope": [165.5, 150.0]},
            {"dtype": "float32", "workload": "tpot", "metric": "tpot_ms",
             "vllm": [40.0, 36.0], "kvscope": [30.0, 45.0]}]
    lines = bench.format_table(rows).splitlines()
    assert len(lines) == 4 and lines[0].startswith("| dtype |")
    # throughput: best is the highest; 165.5 / 232.6
    assert "| 232.6 | 165.5 | 0.71x |" in lines[2]
    # latency: best is the lowest; kvscope 30 ms vs vLLM 36 ms is 1.20x better
    assert "| 36.0 | 30.0 | 1.20x |" in lines[3]
    assert "200.0 232.6" in lines[2] and "30.0 45.0" in lines[3]


def test_percentile_is_nearest_rank():
    values = [float(x) for x in range(1, 101)]
    assert bench.percentile(values, 50) == 50.0
    assert bench.percentile(values, 99) == 99.0
    assert bench.percentile([7.0], 99) == 7.0
    assert not math.isnan(bench.percentile([3.0, 1.0], 50))


def test_prompts_are_seeded_and_mixed_length():
    a, b = bench.make_prompts(32, 0), bench.make_prompts(32, 0)
    assert a == b and len(a) == 32
    lengths = [len(p.split()) for p in a]
    assert min(lengths) >= 8 and max(lengths) <= 300 and max(lengths) - min(lengths) > 100


def test_unknown_workload_is_a_clear_error_before_anything_starts(tmp_path):
    # --vllm-python and --hf-dir point at existing things, so nothing is built or started
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    r = subprocess.run([sys.executable, str(SCRIPT), "--vllm-python", sys.executable,
                        "--hf-dir", str(hf), "--workdir", str(tmp_path),
                        "--workloads", "offline-32x64,nope"],
                       capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode != 0 and "unknown workloads ['nope']" in r.stderr


def test_small_values_keep_two_decimals():
    rows = [{"dtype": "float32", "workload": "served c4", "metric": "req_per_s",
             "vllm": [0.98, 0.75], "kvscope": [0.49, 0.5]}]
    assert "| 0.98 | 0.50 | 0.51x | 0.98 0.75 | 0.49 0.50 |" in bench.format_table(rows)


def test_table_with_the_previous_release_has_a_column_and_ratio_for_each_kvscope():
    rows = [{"dtype": "float32", "workload": "offline-32x64", "metric": "tok_per_s",
             "vllm": [200.0], "kvscope-before": [100.0], "kvscope": [250.0]}]
    head, _, row = bench.format_table(rows).splitlines()
    assert "kvscope before (best) | kvscope (best) | kvscope before/vLLM | kvscope/vLLM" in head
    assert "| 200.0 | 100.0 | 250.0 | 0.50x | 1.25x | 200.0 | 100.0 | 250.0 |" in row


def test_before_ref_that_is_not_a_commit_is_a_clear_error(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    r = subprocess.run([sys.executable, str(SCRIPT), "--vllm-python", sys.executable,
                        "--hf-dir", str(hf), "--workdir", str(tmp_path),
                        "--before", "no-such-ref-xyz"],
                       capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode != 0 and "--before no-such-ref-xyz: not a commit" in r.stderr


def _state(pid: int) -> str:
    # /proc/PID/stat: "pid (comm) STATE ..."
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_the_measured_worker_runs_alone_and_paused_groups_still_end(tmp_path):
    """run_alone stops every other worker's process group (state T) and wakes the measured
    one; process_group's exit ends a paused group too. (The signals take effect
    asynchronously: the test waits for the states, however long the kernel takes.)"""
    with bench.process_group(["sleep", "600"], tmp_path / "a.log", {}) as a, \
            bench.process_group(["sleep", "600"], tmp_path / "b.log", {}) as b:
        workers = {"a": bench.Worker(a), "b": bench.Worker(b)}
        assert bench.run_alone(workers, "a") is workers["a"]
        wait_until(lambda: _state(b.pid) == "T" and _state(a.pid) != "T", "b stopped, a not")
        bench.run_alone(workers, "b")
        wait_until(lambda: _state(a.pid) == "T" and _state(b.pid) != "T", "a stopped, b woken")
    assert a.poll() is not None and b.poll() is not None
