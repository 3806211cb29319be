"""kvscope inside vLLM 0.33's own scheduler (in its own venv: ``make test`` builds
``.venv-vllm033`` and points KVSCOPE_VLLM033_PYTHON at it; never a dependency of kvscope).

vLLM 0.33 has no CPU build, so this is the scheduler-level check: ``vllm_plugin/drive033.py``
builds vLLM 0.33's real ``Scheduler``, ``KVCacheManager`` and ``BlockPool`` without a
model, as vLLM's own unit tests do, and steps them with made-up model outputs over a
24-block pool (prefix hits, evictions, preemptions, aborts, ``reset_prefix_cache`` with
and without running requests), the plugin recording and ``vllm_plugin/vllm_expect.py``
writing vLLM's own state at every batch. The acceptance property is test_vllm_plugin.py's:
the state rebuilt from the recording equals vLLM's (every block's ref count and hash,
every request's table, status and computed tokens) after every step, the plugin reading
only what each step touched and its full-read check (every 4 steps here) never finding a
difference; and the requests the reset preempted are said preempted by a reset. Configs:
full attention; a hybrid model (a full-attention and a sliding-window group sharing the
pool); lookahead block hashes. About a minute each on the loaded 2-core box, most of it
vLLM's imports.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvscope.engine.events import schema as S
from kvscope.engine.events.causes import R_RESET, REASON
from kvscope.engine.events.wire.recording import Recording
from tests.events.test_vllm_plugin import _check

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent / "vllm_plugin"
# absolute, not resolved: the venv's python is a link the venv's own site depends on
VLLM_PY = str(Path(os.environ.get("KVSCOPE_VLLM033_PYTHON")
                   or ROOT / ".venv-vllm033" / "bin" / "python").absolute())
RUN_GUARD_S = 600  # imports on a loaded 2-core box, plus the run: a hang guard only
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(RUN_GUARD_S + 120),
    pytest.mark.skipif(not Path(VLLM_PY).exists(), reason=(
        f"no vLLM 0.33 venv at {VLLM_PY}: `make test` builds .venv-vllm033 (vllm 0.33.0 "
        "beside torch 2.13 CPU); or set KVSCOPE_VLLM033_PYTHON")),
]


def _drive(out: Path, case: str) -> tuple[Path, Path, dict]:
    rec, expect = out / "run.kvtrace", out / "expect.jsonl"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "VLLM_TARGET_DEVICE": "cpu",
           "KVSCOPE_RECORD": str(rec), "KVSCOPE_TEST_EXPECT": str(expect)}
    env.pop("KVSCOPE_EVENTS", None)
    env.pop("PYTHONPATH", None)  # the venv's own kvscope (make test's editable install)
    with open(out / "vllm.log", "w") as log:
        r = subprocess.run([VLLM_PY, str(HERE / "drive033.py"), str(out), case],
                           stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out,
                           timeout=RUN_GUARD_S)
    assert r.returncode == 0, (out / "vllm.log").read_text()[-4000:]
    return rec, expect, json.loads((out / "result.json").read_text())


@pytest.mark.parametrize("case", ["full", "hybrid", "lookahead"])
def test_state_from_the_plugins_events_equals_vllm033s_at_every_step(
        tmp_path: Path, case: str) -> None:
    rec, expect, result = _drive(tmp_path, case)
    assert result["vllm_version"].startswith("0.33.")
    assert result["groups"] == (2 if case == "hybrid" else 1)
    assert result["num_hash_lookahead_tokens"] == (1 if case == "lookahead" else 0)
    assert result["aborted"] == 2, result
    # what each case is for, seen at vLLM's step boundaries: full, computed blocks still
    # unhashed (lookahead hashes), window tables headed by vLLM's null block (hybrid)
    assert bool(result["full_unhashed_blocks"]) == (case == "lookahead"), result
    assert bool(result["null_headed_tables"]) == (case == "hybrid"), result
    counts = _check(rec, expect, version="0.33.", num_blocks=24, block_size=16)
    # the reset that preempted the running requests named itself as their cause
    assert result["running_at_reset"], result
    with Recording(rec) as recording:
        reasons = [ev.get("cause", {}).get(REASON) for b in recording.batches()
                   for ev in b["events"] if ev["kind"] == S.SEQ_PREEMPT]
    assert reasons.count(R_RESET) >= result["running_at_reset"], reasons
    print(f"\n{case}: {result}\n{counts}")
    for kind in (S.TIER_INIT, S.SEQ_ADD, S.SEQ_START, S.ALLOC, S.HIT, S.STORE, S.EVICT,
                 S.FREE, S.SEQ_PREEMPT, S.SEQ_RESUME, S.SEQ_FINISH, S.SEQ_TOKENS):
        assert counts.get(kind), f"the workload never made vLLM {kind}: {counts}"
