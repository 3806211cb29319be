"""SIGKILL of the daemon mid-recording (issue 19): no drain, no index, maybe half a
frame at the end. The recording must still open (with a warning), replay every batch
it holds from its first keyframe without an error, and reach its last complete batch,
which is a recent step of the run."""

from __future__ import annotations

import json
import threading
import time
import warnings
from pathlib import Path

import httpx

from engine.events.recording import Recording, RecordingWarning
from engine.events.state import KVState
from tests.server.conftest import start_daemon


def test_sigkill_leaves_a_recording_readable_to_its_last_complete_batch(tmp_path: Path):
    path = tmp_path / "killed.kvtrace"
    d = start_daemon("--num-gpu-blocks", "64", "--max-model-len", "256",
                     "--max-num-seqs", "4", record=path)
    chunks = []

    def stream() -> None:
        try:
            with httpx.stream("POST", d.url + "/v1/completions", timeout=120, json={
                    "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
                    "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
        except httpx.HTTPError:
            pass  # the daemon dies under it

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while len(chunks) < 60 and time.monotonic() < deadline:  # > 1 s of steps recorded
        time.sleep(0.05)
    assert len(chunks) >= 60, "the streams never got going"
    d.proc.kill()  # SIGKILL: nothing runs in the daemon after this
    d.proc.wait(30)
    d.proc.stdout.close()
    for t in threads:
        t.join(60)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = Recording(path)
    assert any(issubclass(w.category, RecordingWarning) for w in caught)
    with rec:
        assert rec.steps and rec.keyframe_steps
        last = rec.steps[-1]
        # Steps of the streaming run made it to disk: the writer flushes every 64 steps
        # or 1 s, so at most that much is lost with the process.
        assert last >= 5 and last >= len(chunks) // 3 - 64  # ~one decode step per chunk
        state = None
        for batch in rec.batches(start_step=rec.keyframe_steps[0] + 1):
            if state is None:
                state = rec.state_at(rec.keyframe_steps[0])
            state.apply(batch)  # every batch it holds replays cleanly
        final = rec.state_at(last)
        assert isinstance(final, KVState) and final.step == last
        assert state is None or state.canonical() == final.canonical()
