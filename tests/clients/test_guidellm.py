"""guidellm (the vLLM project's load tester), unmodified, at a fixed concurrency with
synthetic prompts made by the model's own tokenizer: every request must succeed (the
router's pass-through is shown by the openai client's streamed chat)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.clients.conftest import MODEL_NAME
from tests.server.conftest import Daemon

REQUESTS = 8
RUN_GUARD_S = 900  # a hang guard: a healthy run takes about a minute on a loaded 2-core box


@pytest.mark.timeout(RUN_GUARD_S + 300)
def test_guidellm_concurrent_all_requests_succeed(daemon: Daemon, hf_tokenizer_dir: Path,
                                                  tmp_path: Path):
    out = tmp_path / "guidellm.json"
    guidellm = Path(sys.executable).parent / "guidellm"
    r = subprocess.run(
        [str(guidellm), "benchmark", "--target", daemon.url, "--model", MODEL_NAME,
         "--processor", str(hf_tokenizer_dir),
         "--data", "prompt_tokens=32,output_tokens=8",
         # "4.0", not "4": guidellm 0.2.1 rejects an int rate for rate-type concurrent
         "--rate-type", "concurrent", "--rate", "4.0", "--max-requests", str(REQUESTS),
         "--disable-progress", "--disable-console-outputs", "--output-path", str(out)],
        capture_output=True, text=True, timeout=RUN_GUARD_S)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    bench = json.loads(out.read_text())["benchmarks"][0]
    assert bench["request_totals"] == {"successful": REQUESTS, "errored": 0, "incomplete": 0,
                                       "total": REQUESTS}
    outputs = [s["output_tokens"] for s in bench["requests"]["successful"]]
    assert outputs == [8] * REQUESTS  # guidellm sends ignore_eos: every answer is full
