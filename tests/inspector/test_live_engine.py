"""Live mode against the real engine (SmolLM2 on CPU) publishing on loopback: the window
joins late and converges to the engine's own kv_state(); the engine is closed and a new one
starts on the same endpoint, and the window follows it."""

from __future__ import annotations

import socket

import pytest

from kvscope.engine.config import EngineConfig
from kvscope.engine.engine import LLMEngine
from kvscope.engine.sampling_params import SamplingParams
from kvscope.inspector.sources.live import LiveSource
from tests.waiting import HANG_MS

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    import torch

    from kvscope.engine.model import load_model

    torch.set_num_threads(1)
    return load_model("smollm2", device="cpu", dtype=torch.float32)


def free_port_pair() -> int:
    """A port p with p + 1 also free (the snapshot endpoint defaults to port + 1)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no pair of free loopback ports")


def start_engine(loaded, endpoint: str, prompts: list[str]) -> LLMEngine:
    eng = LLMEngine(EngineConfig(block_size=4, num_gpu_blocks=24, watermark=0.0,
                                 events_endpoint=endpoint), loaded=loaded)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, GREEDY)
    return eng


def converged(live: LiveSource, eng: LLMEngine) -> bool:
    live.tick()
    return live.model.state.canonical() == eng.kv_state()


def test_live_window_follows_real_engine_and_restart(window, qtbot, loaded):  # noqa: ANN001
    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    eng = start_engine(loaded, endpoint, ["The capital of France is", "Count: 1, 2, 3,",
                                          "Roses are red,"])
    for _ in range(3):  # the window joins late
        eng.step()
    live = LiveSource(endpoint, window.model)
    window.attach_live(live, endpoint)
    live.start()
    try:
        # Joined (the snapshot, taken while the engine idles) and subscribed (a heartbeat
        # arrived live) before the next step: every later batch arrives live, no gap.
        qtbot.waitUntil(lambda: (live.tick(), live.sub.status != "waiting"
                                 and live.sub.live_messages > 0)[1], timeout=HANG_MS)
        while eng.has_unfinished_requests():
            eng.step()
            live.tick()
            qtbot.wait(1)
        qtbot.waitUntil(lambda: converged(live, eng), timeout=HANG_MS)
        assert eng.step_count > 3 and live.sub.gaps == 0

        eng.close()  # the engine goes away; a new one starts on the same endpoint
        eng = start_engine(loaded, endpoint, ["Once upon a time", "The sky is"])
        eng.step()
        eng.step()
        qtbot.waitUntil(lambda: converged(live, eng), timeout=HANG_MS)
        assert live.sub.restarts >= 1 and live.sub.epoch == eng.events.epoch
        assert {r[0] for r in window.sequences.visible_rows()} == set(eng.kv_state()["seqs"])
    finally:
        live.stop()
        eng.close()
