"""scripts/bench_publish_overhead.py's comparison of an events-off and an events-on engine.

The first device run (H200, 2026-11-27) reported the events-on engine 54% FASTER than the
off one: the off engine always stepped first, so it alone paid the process's one-off costs
(each Triton kernel's first compile) and the mean carried them. Here, with simulated
engines on a simulated clock (no real time is measured): a one-off cost that lands on
whichever engine steps first must not show up as overhead, and a real per-step cost must.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location(
        "bench_publish_overhead", ROOT / "scripts" / "bench_publish_overhead.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_publish_overhead"] = module
    spec.loader.exec_module(module)
    return module


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimulatedEngine:
    """Steps ``steps`` times; each step advances the shared clock by ``step_s``, and by
    ``once_s`` more for the first step of any engine in the process (a kernel's compile)."""

    compiled = False

    def __init__(self, clock: Clock, steps: int, step_s: float, once_s: float) -> None:
        self.clock, self.left, self.step_s, self.once_s = clock, steps, step_s, once_s

    def has_unfinished_requests(self) -> bool:
        return self.left > 0

    def step(self) -> None:
        self.left -= 1
        self.clock.now += self.step_s
        if not SimulatedEngine.compiled:
            SimulatedEngine.compiled = True
            self.clock.now += self.once_s


def _pairs(on_step_s: float, steps: int = 40, once_s: float = 3.0):
    bench = _module()
    SimulatedEngine.compiled = False
    clock = Clock()
    engines = {"off": SimulatedEngine(clock, steps, 0.010, once_s),
               "on": SimulatedEngine(clock, steps, on_step_s, once_s)}
    return bench, bench.time_alternating(engines, clock=clock)


def test_a_one_off_cost_is_not_overhead():
    bench, pairs = _pairs(on_step_s=0.010)
    assert len(pairs) == 40
    # the old measure (means, off always first) saw the compile as the off engine's cost
    assert sum(p["off"] for p in pairs) > 1.2 * sum(p["on"] for p in pairs)
    r = bench.overhead_of(pairs)
    assert r["overhead_pct"] == pytest.approx(0.0, abs=1e-9)
    assert r["warmup_pairs"] == bench.WARMUP_PAIRS
    assert r["step_ms_off"] == r["step_ms_on"] == 10.0


def test_a_per_step_cost_is_overhead():
    bench, pairs = _pairs(on_step_s=0.0105)
    r = bench.overhead_of(pairs)
    assert r["overhead_pct"] == pytest.approx(5.0, abs=1e-6)
    assert r["step_ms_on"] == 10.5


def test_the_order_inside_a_pair_alternates():
    bench = _module()
    clock, seen = Clock(), []

    class Recorder(SimulatedEngine):
        def __init__(self, name: str) -> None:
            super().__init__(clock, 4, 0.01, 0.0)
            self.name = name

        def step(self) -> None:
            seen.append(self.name)
            super().step()

    bench.time_alternating({"off": Recorder("off"), "on": Recorder("on")}, clock=clock)
    assert seen == ["off", "on", "on", "off", "off", "on", "on", "off"]
