"""The fleet view's replay: recordings of several replicas on one wall-clock axis (each
panel shows its last step at or before the shared instant), and its command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.inspector.batches import synthetic_batches
from tests.inspector.conftest import expected_state, write_recording
from tests.waiting import HANG_S

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def two_recordings(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, list[Path]]:
    a = synthetic_batches(200, seed=1)
    b = synthetic_batches(200, seed=2)
    for x in b:  # the second replica's run starts 5 s later (steps are 50 ms apart)
        x["time"] += 5.0
    d = tmp_path_factory.mktemp("fleet")
    return [a, b], [write_recording(d / "r0.kvtrace", a), write_recording(d / "r1.kvtrace", b)]


def test_replays_share_one_time_axis(app, qtbot, two_recordings) -> None:  # noqa: ANN001
    from kvscope.engine.events.wire.recording import Recording
    from kvscope.inspector.fleet import FleetWindow

    batches, paths = two_recordings
    win = FleetWindow(["r0", "r1"])
    qtbot.addWidget(win)
    win.open_replays([Recording(p) for p in paths], ["r0", "r1"])
    fr = win.replay
    assert fr.t1 - fr.t0 == pytest.approx(5.0 + 199 * 0.05)
    fr.seek_time(fr.t0 + 7.52)  # r0 at 7.52 s: step 150; r1 at 2.52 s: step 50
    steps = [c.step for c in fr.controllers]
    assert steps == [150, 50]
    fr.seek_time(fr.t0 + 6.02)  # backwards for r0 (a seek), forwards for r1 (applied batches)
    fr.seek_time(fr.t0 + 6.22)
    assert [c.step for c in fr.controllers] == [124, 24]
    for panel, bs, step in zip(win.panels, batches, (124, 24), strict=True):
        assert panel.model.state.canonical() == expected_state(bs, step).canonical()
        assert "r0" in panel.header.text() or "r1" in panel.header.text()
    fr.to_end()
    assert [c.step for c in fr.controllers] == [199, 199]


def test_cli_renders_several_recordings(two_recordings, tmp_path: Path) -> None:  # noqa: ANN001
    out = tmp_path / "fleet.png"
    _, paths = two_recordings
    r = subprocess.run([sys.executable, "-m", "kvscope.engine.cli", "inspect", *map(str, paths),
                        "--screenshot", str(out)], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=HANG_S,
                       env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 10_000


def test_a_router_address_that_is_not_a_router_is_a_clear_error() -> None:
    from kvscope.inspector.errors import InspectError
    from kvscope.inspector.fleet import resolve_router

    with pytest.raises(InspectError, match="not a kvscope router"):
        resolve_router("http://127.0.0.1:9", timeout=2.0)


def test_the_fleet_view_imports_without_torch() -> None:
    code = ("import sys; sys.modules['torch'] = None; sys.modules['triton'] = None\n"
            "import kvscope.inspector.fleet\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=HANG_S,
                       env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert r.returncode == 0, r.stderr
