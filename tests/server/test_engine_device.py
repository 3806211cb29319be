"""The engine loop makes the engine's CUDA device current on its own thread (a new thread
starts on cuda:0, and Triton launches on the current device). Checked on any machine by
recording the call: the GPU run itself is scripts/gpu_check.py's."""

from __future__ import annotations

import threading
import time

import torch

from engine.server.engine_loop import EngineLoop


class _IdleEngine:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.closed = False

    def has_unfinished_requests(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


def _run_loop(engine, monkeypatch) -> list[tuple[torch.device, threading.Thread]]:
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: calls.append((d, threading.current_thread())))
    loop = EngineLoop(engine)
    loop.start()
    time.sleep(0.05)
    loop.stop()
    assert engine.closed
    return calls


def test_an_engine_on_a_numbered_gpu_sets_it_on_the_engine_thread(monkeypatch):
    calls = _run_loop(_IdleEngine(torch.device("cuda", 1)), monkeypatch)
    assert [d for d, _ in calls] == [torch.device("cuda", 1)]
    assert calls[0][1] is not threading.main_thread()
    assert calls[0][1].name == "kvscope-engine"


def test_a_cpu_engine_sets_no_device(monkeypatch):
    assert _run_loop(_IdleEngine(torch.device("cpu")), monkeypatch) == []
