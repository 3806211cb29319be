"""Load and faults (issue 19), on one recording daemon:

1. 500 concurrent streamed requests whose clients hang up at random points (before the
   answer starts, mid-stream, or never). Afterwards the block pool is empty again,
   nothing is left running, the daemon still serves, and /metrics agrees with what the
   clients saw: every admitted request ended exactly once, as a success or a client
   abort; each that a client saw finish is a success; the token counters match.
2. Then SIGKILL mid-stream (no drain, no index, maybe half a frame at the end): the
   recording must still open (with a warning), replay every batch it holds from its
   first keyframe, and reach its last complete batch, a recent step of the run.
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvscope.engine.events.state import KVState
from kvscope.engine.events.wire.recording import Recording, RecordingWarning
from tests.server.conftest import Daemon, start_daemon, stop_daemon
from tests.waiting import HANG_S

CLIENTS = 500
MAX_TOKENS = 3
PROMPT = [1, 504, 3458, 282, 4649]  # token ids: a fixed prompt length
SEED = 19


async def _client(http: httpx.AsyncClient, url: str, plan: tuple[str, float]) -> str:
    """"done" (saw [DONE]), "finished" (saw the final finish_reason, then hung up) or
    "left" (hung up before the end)."""
    mode, at = plan
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0, "stream": True}

    async def read() -> str:
        seen = 0
        finished = False
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "done"
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                finished |= any(c["finish_reason"] for c in chunk["choices"])
                seen += 1
                if mode == "after" and seen >= at:
                    return "finished" if finished else "left"  # closing the stream
        raise AssertionError("stream ended without [DONE]")

    if mode == "cancel":  # hang up after `at` seconds, wherever the request is
        try:
            return await asyncio.wait_for(read(), at)
        except TimeoutError:
            return "left"
    return await read()


async def _run_all(url: str, plans: list[tuple[str, float]]) -> list[str]:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=HANG_S, limits=limits) as http:
        return await asyncio.gather(*(_client(http, url, p) for p in plans))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """Its own daemon, recording, with room for a wide batch (500 streams in well under
    a minute). The last test of the module kills it."""
    d = start_daemon("--num-gpu-blocks", "160", "--max-model-len", "256",
                     "--max-num-seqs", "128",
                     record=tmp_path_factory.mktemp("rec") / "killed.kvtrace")
    yield d
    stop_daemon(d)


def _aborted_by_client(d: Daemon) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(d.url + "/metrics", timeout=HANG_S).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "kvscope:request_aborted_total"
               and s.labels.get("reason") == "client")


def test_500_streams_with_random_hangups(daemon: Daemon):
    rng = random.Random(SEED)
    plans = []
    for _ in range(CLIENTS):
        r = rng.random()
        if r < 0.5:
            plans.append(("full", 0.0))
        elif r < 0.85:
            plans.append(("after", float(rng.randint(1, MAX_TOKENS))))
        else:
            plans.append(("cancel", rng.uniform(0.05, 3.0)))
    before = daemon.metrics()
    before.setdefault("kvscope:request_success_total", 0.0)  # absent before any success
    aborted_before = _aborted_by_client(daemon)
    outcomes = asyncio.run(_run_all(daemon.url, plans))

    daemon.wait_metric("kvscope:num_requests_running", 0.0)
    m = daemon.wait_metric("kvscope:num_requests_waiting", 0.0)
    succeeded = m["kvscope:request_success_total"] - before["kvscope:request_success_total"]
    aborted = _aborted_by_client(daemon) - aborted_before
    saw_end = sum(o in ("done", "finished") for o in outcomes)
    # Each admitted request ended exactly once. A client that hung up while its body was
    # still being read was never admitted, so only "cancel" hang-ups may be missing.
    cancelled = sum(p[0] == "cancel" and o == "left" for p, o in zip(plans, outcomes,
                                                                     strict=True))
    assert CLIENTS - cancelled <= succeeded + aborted <= CLIENTS
    assert succeeded >= saw_end  # a client that saw its request finish: a success
    assert aborted <= outcomes.count("left")
    assert outcomes.count("left") > 50 and outcomes.count("done") > 200  # the plan ran
    gen = m["kvscope:generation_tokens_total"] - before["kvscope:generation_tokens_total"]
    prompt = m["kvscope:prompt_tokens_total"] - before["kvscope:prompt_tokens_total"]
    assert gen == succeeded * MAX_TOKENS and prompt == succeeded * len(PROMPT)
    assert m["kvscope:kv_cache_usage_perc"] == 0.0  # the block pool is empty again
    assert m["kvscope:num_requests_running"] == m["kvscope:num_requests_waiting"] == 0
    r = httpx.post(daemon.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                   timeout=HANG_S)
    assert r.status_code == 200


def _steps_recorded(path: Path) -> int:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordingWarning)
        with Recording(path) as rec:
            return rec.steps[-1] if rec.steps else 0


def test_sigkill_leaves_a_recording_readable_to_its_last_complete_batch(daemon: Daemon):
    """Runs last in this module: it kills the daemon."""
    d = daemon
    path = d.record
    steps_before = _steps_recorded(path)
    chunks: list[dict] = []

    def stream() -> None:
        try:
            with httpx.stream("POST", d.url + "/v1/completions", timeout=HANG_S, json={
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
    # Kill mid-stream, once steps of this run are on disk: the writer flushes every 64
    # steps or 1 s, whichever comes first, so they get there while the 200-token
    # streams still run, however fast the box steps. (The clock decides nothing here.)
    deadline = time.monotonic() + HANG_S
    while len(chunks) < 150 or _steps_recorded(path) <= steps_before:
        assert time.monotonic() < deadline, "no step of the streams reached the disk"
        time.sleep(0.05)
    d.proc.kill()  # SIGKILL: nothing runs in the daemon after this
    d.proc.wait(HANG_S)
    d.proc.stdout.close()
    for t in threads:
        t.join(HANG_S)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = Recording(path)
    assert any(issubclass(w.category, RecordingWarning) for w in caught)
    with rec:
        assert rec.steps and rec.keyframe_steps
        last = rec.steps[-1]
        # Steps of the streaming run made it to disk: the writer flushes every 64 steps
        # or 1 s, so at most that much is lost with the process.
        assert last > steps_before  # steps of this streaming run made it to disk
        state = None
        for batch in rec.batches(start_step=rec.keyframe_steps[0] + 1):
            if state is None:
                state = rec.state_at(rec.keyframe_steps[0])
            state.apply(batch)  # every batch it holds replays cleanly
        final = rec.state_at(last)
        assert isinstance(final, KVState) and final.step == last
        assert state is None or state.canonical() == final.canonical()
