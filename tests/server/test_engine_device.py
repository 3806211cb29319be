"""The engine loop makes the engine's CUDA device current on its own thread (a new thread
starts on cuda:0, and Triton launches on the current device). Checked on any machine by
recording the call: the GPU run itself is scripts/gpu_check.py's."""

from __future__ import annotations

import threading

import torch

from kvscope.engine.server.engine_loop import EngineLoop
from tests.server.doubles import ScriptedLLMEngine


def _run_loop(engine, monkeypatch) -> list[tuple[torch.device, threading.Thread]]:
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device",
                        lambda d: calls.append((d, threading.current_thread())))
    loop = EngineLoop(engine)
    loop.start()
    loop.stop()  # the thread sets the device before it reads its first command
    assert engine.closed
    return calls


def test_an_engine_on_a_numbered_gpu_sets_it_on_the_engine_thread(monkeypatch):
    calls = _run_loop(ScriptedLLMEngine(device=torch.device("cuda", 1)), monkeypatch)
    assert [d for d, _ in calls] == [torch.device("cuda", 1)]
    assert calls[0][1] is not threading.main_thread()
    assert calls[0][1].name == "kvscope-engine"


def test_a_cpu_engine_sets_no_device(monkeypatch):
    assert _run_loop(ScriptedLLMEngine(device=torch.device("cpu")), monkeypatch) == []
