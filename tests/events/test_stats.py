"""The step statistics are one named type (engine.events.stats.StepStats): its wire form
is the map the engine has always written, and reading any map, old, newer or broken,
never fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.engine.events.stats import StepStats, TierStats
from kvscope.engine.events.wire.recording import Recording

ROOT = Path(__file__).resolve().parents[2]
RECORDINGS = [ROOT / "assets" / "sample.kvtrace",
              *sorted((ROOT / "tests" / "events" / "fixtures").glob("*.kvtrace"))]


def test_the_wire_form_holds_the_reported_fields_only():
    st = StepStats(running=2, waiting=0, step_time_s=0.5,
                   tiers={"gpu": TierStats(total=8, used=3, cached=1, free=4)})
    m = st.to_map()
    assert m == {"running": 2, "waiting": 0, "step_time_s": 0.5,
                 "tiers": {"gpu": {"total": 8, "used": 3, "cached": 1, "free": 4}}}
    assert StepStats.read(m) == st


@pytest.mark.parametrize("path", RECORDINGS, ids=lambda p: p.name)
def test_every_recorded_key_is_declared_and_reads_back_the_same(path):
    """Recordings of every protocol version (the engine's own, the synthetic fixtures):
    each stats map is exactly the wire form of what StepStats reads from it."""
    with Recording(path) as rec:
        n = 0
        for batch in rec.batches():
            m = batch["stats"]
            assert StepStats.read(m).to_map() == m, batch["step"]
            n += bool(m)
    assert n > 10


def test_missing_extra_and_broken_values_read_as_not_reported():
    st = StepStats.read({"running": 3, "waiting": "many", "from_the_future": [1],
                         "step_time_s": 2, "tiers": {"gpu": {"total": 10, "free": "x"},
                                                     "cpu": 7}})
    assert st.running == 3 and st.waiting is None and st.swapped is None
    assert st.step_time_s == 2.0
    assert st.tier("gpu") == TierStats(total=10)
    assert st.tier("cpu") == TierStats() and st.tier("disk") == TierStats()
    for junk in (None, [1, 2], "stats", 5):
        assert StepStats.read(junk) == StepStats()
    assert StepStats.read(st) is st


def test_used_blocks_from_total_free_and_cached():
    assert TierStats(total=10, used=4).used_blocks() == 4
    assert TierStats(total=10, free=3, cached=2).used_blocks() == 5
    assert TierStats(total=10, free=3).used_blocks() is None
