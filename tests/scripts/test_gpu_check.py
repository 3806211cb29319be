"""scripts/gpu_check.py runs on the GPU device only in a session that has one; CI runs its
``--smoke`` mode (tiny shapes on CPU, Triton under the interpreter) so every section's code
path is exercised here, and checks that one failing section does not stop the others."""

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


# Each section stops its fixed work at its time budget (60 s in --smoke; a pytest section is
# killed there): a loaded box would cut a section short and fail a correct run. Here every
# budget is a hang guard, and the run's whole time gets one too (a healthy run: minutes).
SECTION_GUARD_S = 600


@pytest.mark.timeout(3 * SECTION_GUARD_S)
def test_smoke_runs_every_section_on_cpu(tmp_path):
    gpu_check = _module()
    budgets = [f"--budget={name}={SECTION_GUARD_S}" for name in gpu_check.SECTIONS]
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path), "--smoke", *budgets],
                          cwd=ROOT, capture_output=True, text=True,
                          timeout=3 * SECTION_GUARD_S - 60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = report["sections"]
    assert list(sections) == list(gpu_check.SECTIONS)
    for name, result in sections.items():  # "miss": measured, a performance goal not met
        assert result["status"] in ("ok", "miss"), (name, result)
    assert sections["device"]["copy_tb_s"] > 0
    assert sections["kernels"]["passed"] >= 1 and sections["invariance"]["passed"] >= 2
    assert sections["quant"]["fp32_paged_vs_contiguous"]["identical"] == "4/4"
    row = sections["attention"]["rows"][0]
    assert row["auto"]["ms"] > 0 and row["int8"]["speedup_vs_bf16"] > 0 and "sdpa" in row
    assert [r["batch"] for r in sections["decode"]["rows"]] == [1, 4]
    # CPU: nothing synchronises, and graphs are CUDA-only
    assert sections["syncs"]["eager"]["steps"] == 8 and "graphs" not in sections["syncs"]
    assert sections["syncs"]["eager"]["syncs_per_step"] == 0
    assert sections["events"]["events"] > 0
    assert sections["offline"]["kvscope"]["generated"] == sections["offline"]["output_tokens"]
    hf = sections["offline"]["hf"]
    assert hf.startswith("not available") if isinstance(hf, str) else hf["tokens_per_s"] > 0
    assert sections["capacity"]["paged_peak_running"] >= 1
    assert sections["swap"]["swap_out_gb_s"] > 0
    # the table comes last, and as markdown beside the JSON
    assert proc.stdout.rstrip().splitlines()[-1].startswith("full results:")
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| swap |" in md and report["meta"]["torch"] in md
    assert "section" in proc.stdout and "swap" in proc.stdout.splitlines()[-3]


def test_a_failing_section_is_reported_and_the_next_still_runs(tmp_path, monkeypatch, capsys):
    gpu_check = _module()

    def broken(ctx):
        raise RuntimeError("planted failure")

    monkeypatch.setitem(gpu_check.RUNNERS, "device", broken)
    monkeypatch.setitem(gpu_check.RUNNERS, "quant", lambda ctx: {"summary": "fine"})
    assert gpu_check.main([str(tmp_path), "--smoke", "--sections", "quant,device"]) == 1
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert list(sections) == ["device", "quant"]  # the documented order
    assert sections["device"]["status"] == "error"
    assert "planted failure" in sections["device"]["traceback"]
    assert sections["quant"]["status"] == "ok"
    out = capsys.readouterr().out
    assert "RuntimeError: planted failure" in out and "fine" in out


def test_unknown_section_and_missing_gpu_are_clear_errors(tmp_path, capsys):
    gpu_check = _module()
    with pytest.raises(SystemExit) as exc:
        gpu_check.main([str(tmp_path), "--sections", "device,nosuch"])
    assert exc.value.code == 2
    assert "unknown section(s) ['nosuch']" in capsys.readouterr().err
    import torch

    if not torch.cuda.is_available():
        assert gpu_check.main([str(tmp_path), "--sections", "device"]) == 2
        assert "use --smoke" in capsys.readouterr().err
