"""scripts/gpu_check.py runs on the GPU device only in a session that has one. Here: its
plan fits the 15-minute window (run 1 <= 420 s of work, run 2 <= 240 s, at most 8 files
back per run), its ``--smoke`` mode (tiny shapes on CPU, Triton under the interpreter)
runs every section's code path and writes a JSON per section, and a section that raises,
dies or hangs is recorded while the next one still runs."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_plan_fits_one_window():
    gpu_check = _module()
    import gpu_sections

    by_run = {run: [s for s in gpu_check.PLAN if s.run == run] for run in (1, 2)}
    assert sum(s.budget_s for s in by_run[1]) <= 420
    assert sum(s.budget_s for s in by_run[2]) <= 240
    assert gpu_check.RUN_LIMITS_S == {1: 420, 2: 240}
    # run 1 answers correctness first, then the numbers, in the order
    assert [s.name for s in by_run[1]] == ["device", "kernels", "invariance", "decode",
                                           "attention", "events"]
    assert {s.name for s in by_run[2]} == {"offline", "capacity", "swap", "quant"}
    assert set(gpu_check.SECTIONS) == set(gpu_sections.RUNNERS)
    for sections in by_run.values():  # a JSON per section, the table and the log come back
        assert len(sections) + 2 <= gpu_check.MAX_FILES


def test_list_prints_each_section_with_its_budget_and_run(capsys):
    gpu_check = _module()
    assert gpu_check.main(["--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    for s in gpu_check.PLAN:
        assert any(line.split()[:3] == [str(s.run), s.name, str(s.budget_s)] for line in out)
    assert "run 1: 390 s of work at most (limit 420 s)" in out
    assert "run 2: 240 s of work at most (limit 240 s)" in out


def test_the_recipe_shows_the_plan_and_a_run_command_the_device_takes():
    """docs/GPU.md carries --list's output as it is, and run 1's command fits the device
    tool's 2,000 characters."""
    gpu_check = _module()
    doc = (ROOT / "docs" / "GPU.md").read_text()
    assert "\n".join("    " + line for line in gpu_check.plan_text().splitlines()) in doc
    run1 = [line.strip() for line in doc.splitlines() if "gpu_check.py $OUT --run 1" in line]
    assert len(run1) == 1 and len(run1[0]) <= 2000
    assert "--target /tmp/site .whl/*.whl" in run1[0]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a hang guard: ten processes, two of them pytest, on 2 busy cores
def test_every_test_the_plan_runs_exists():
    """The kernels and invariance sections name tests by id; --smoke runs one of each
    section's CPU tests, so every id is checked here (collected, none missing)."""
    _module()
    import gpu_sections

    ids = [*gpu_sections.KERNEL_TESTS, *gpu_sections.INVARIANCE_TESTS]
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *ids], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    collected = proc.stdout.splitlines()
    for test in ids:
        assert any(line.startswith(test) for line in collected), test


def test_smoke_runs_every_section_on_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    gpu_check = _module()
    sections = {s.name: json.loads((tmp_path / f"{s.name}.json").read_text())
                for s in gpu_check.PLAN}
    for name, result in sections.items():  # "miss": measured, a performance goal not met
        assert result["status"] in ("ok", "miss"), (name, result)
        assert result["section"] == name and result["smoke"] is True
        assert result["meta"]["torch"] and result["seconds"] >= 0
    assert sections["device"]["copy_tb_s"] > 0
    # the 8B-shape grid (gpu-marked) and the CUDA-graph tests are collected and skip here;
    # one test of the rest runs (under the interpreter), enough to prove the plumbing
    kernels, invariance = sections["kernels"], sections["invariance"]
    assert kernels["skipped"] == 24 and kernels["passed"] >= 1 and not kernels["failed"]
    assert invariance["skipped"] == 2 and invariance["passed"] == 1
    assert [r["batch"] for r in sections["decode"]["rows"]] == [1, 4]
    # CPU: nothing synchronises, and graphs are CUDA-only
    assert sections["decode"]["syncs"]["eager"]["syncs_per_step"] == 0
    assert "graphs" not in sections["decode"]["syncs"]
    # where the profiled step's time goes: the parts add up to the step's total
    parts = sections["decode"]["kernel_breakdown"]
    assert parts["ms_per_step"] > 0 and parts["top_kernels_ms_per_step"]
    assert sum(parts["parts_ms_per_step"].values()) == pytest.approx(parts["ms_per_step"],
                                                                       abs=0.01)
    row = sections["attention"]["rows"][0]
    assert row["auto"]["ms"] > 0 and row["int8"]["speedup_vs_bf16"] > 0 and "sdpa" in row
    _module()  # puts scripts/ on the path
    import gpu_sections  # each smoke launch configuration, for both page formats
    launches = sections["attention"]["launch_sweep"]
    assert len(launches) == 2 * len(gpu_sections.launches(smoke=True))
    assert all(r["ms"] > 0 for r in launches)
    assert sections["events"]["events"] > 0 and sections["events"]["steps"] > 0
    assert sections["offline"]["kvscope"]["generated"] == sections["offline"]["output_tokens"]
    hf = sections["offline"]["hf"]
    assert hf.startswith("not available") if isinstance(hf, str) else hf["tokens_per_s"] > 0
    assert sections["capacity"]["paged_peak_running"] >= 1
    assert sections["swap"]["swap_out_gb_s"] > 0
    assert sections["quant"]["fp32_paged_vs_contiguous"]["identical"] == "4/4"
    # the table comes last, and as markdown beside the JSON files, with the whole log
    lines = proc.stdout.rstrip().splitlines()
    assert lines[-1].startswith("results:") and lines[-3].startswith("quant")
    md = (tmp_path / "smoke.md").read_text()
    assert "| quant |" in md and sections["device"]["meta"]["torch"] in md
    assert "===== kernels" in (tmp_path / "smoke.log").read_text()


def test_a_raising_section_records_its_traceback(tmp_path, monkeypatch):
    gpu_check = _module()
    import gpu_sections

    def broken(ctx):
        raise RuntimeError("planted failure")

    monkeypatch.setitem(gpu_sections.RUNNERS, "device", broken)
    assert gpu_check.main([str(tmp_path), "--section", "device", "--smoke"]) == 1
    result = json.loads((tmp_path / "device.json").read_text())
    assert result["status"] == "error" and "planted failure" in result["traceback"]
    assert result["summary"] == "RuntimeError: planted failure"


def test_a_run_goes_on_past_a_section_that_dies_or_hangs(tmp_path, capsys):
    """Each section is a process: one that exits without a result is an error, one past its
    budget is killed (its process group too) and a timeout; the next still runs, and the
    table and the exit code say so."""
    gpu_check = _module()
    Section = gpu_check.Section
    plan = [Section("device", 1, 60, "dies"), Section("kernels", 1, 1, "hangs"),
            Section("decode", 1, 60, "fine")]
    writes = ("import json, sys; json.dump({'status': 'ok', 'summary': 'fine'}, "
              "open(sys.argv[1], 'w'))")
    programs = {"device": ["-c", "import sys; print('planted crash'); sys.exit(3)"],
                "kernels": ["-c", "import time; time.sleep(600)"],
                "decode": ["-c", writes, str(tmp_path / "decode.json")]}

    def command(out_dir, name, smoke):
        return [sys.executable, *programs[name]]

    assert gpu_check.run_plan(tmp_path, plan, False, "run1", command) == 1
    results = {s.name: json.loads((tmp_path / f"{s.name}.json").read_text()) for s in plan}
    assert results["device"]["status"] == "error"
    assert "exited 3" in results["device"]["summary"]
    assert "planted crash" in results["device"]["summary"]
    assert results["kernels"]["status"] == "timeout"
    assert "killed at its 1 s budget" in results["kernels"]["summary"]
    assert results["decode"]["status"] == "ok"
    md = (tmp_path / "run1.md").read_text()
    assert "| device | error |" in md and "| kernels | timeout |" in md
    assert "| decode | ok |" in md
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-3].startswith("decode ")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "decode.json", "device.json", "kernels.json", "run1.log", "run1.md"]


def test_bad_arguments_and_a_missing_gpu_are_clear_errors(tmp_path, capsys):
    gpu_check = _module()
    with pytest.raises(SystemExit) as exc:
        gpu_check.main([str(tmp_path), "--section", "nosuch"])
    assert exc.value.code == 2
    assert "invalid choice: 'nosuch'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.main([str(tmp_path)])
    assert "choose --run 1, --run 2, --section NAME or --smoke" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        assert gpu_check.main([str(tmp_path), "--run", "1"]) == 2
        assert "use --smoke" in capsys.readouterr().err
