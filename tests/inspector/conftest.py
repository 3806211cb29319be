"""Inspector test fixtures: offscreen Qt, recordings written from synthetic batches, and
the artifacts folder the screenshots go to."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

import pytest  # noqa: E402

from kvscope.engine.events import KVState  # noqa: E402
from kvscope.engine.events.wire.recording import RecordingWriter  # noqa: E402
from tests.inspector.batches import synthetic_batches  # noqa: E402

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
BIG = {"gpu_blocks": 1024, "cpu_blocks": 256, "max_running": 16, "arrival_rate": 0.9}


def write_recording(path: Path, batches: list[dict], **kw) -> Path:
    state = KVState()
    with RecordingWriter(path, {"source": "test"}, keyframe_every_steps=50,
                         keyframe_every_s=1e9, **kw) as w:
        for b in batches:
            state.apply(b)
            w.add(b, state)
    return path


@pytest.fixture(scope="session")
def batches() -> list[dict]:
    return synthetic_batches(300, seed=3, **BIG)


@pytest.fixture(scope="session")
def recording_path(tmp_path_factory: pytest.TempPathFactory, batches: list[dict]) -> Path:
    return write_recording(tmp_path_factory.mktemp("rec") / "run.kvtrace", batches)


@pytest.fixture
def artifacts() -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    return ARTIFACTS


@pytest.fixture
def app(qapp):  # noqa: ANN001
    """The QApplication as ``kvscope inspect`` sets it up (theme, GUI-thread collection;
    tests/conftest.py collects the test's Qt garbage and restores automatic collection)."""
    from kvscope.inspector.app import make_app

    return make_app()


@pytest.fixture
def window(app, qtbot):  # noqa: ANN001
    from kvscope.inspector.window import MainWindow

    w = MainWindow()
    qtbot.addWidget(w)
    w.resize(1600, 1000)
    w.show()
    return w


@pytest.fixture
def replay_window(window, recording_path):  # noqa: ANN001
    from kvscope.inspector.app import open_recording

    rec, notes = open_recording(recording_path)
    assert notes == []
    window.open_replay(rec, recording_path.name)
    return window


def expected_state(batches: list[dict], step: int) -> KVState:
    """Ground truth: every batch up to ``step`` applied to a fresh mirror, no keyframes."""
    st = KVState()
    for b in batches:
        if b["step"] > step:
            break
        st.apply(b)
    return st
