"""`kvscope inspect` on the command line, bad files, and the torch-free import seam."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvscope.engine.events import PROTOCOL_VERSION
from kvscope.engine.events.wire.recording import RecordingWriter
from kvscope.inspector.app import open_recording, run
from kvscope.inspector.errors import InspectError
from tests.inspector.conftest import write_recording
from tests.waiting import HANG_S

ROOT = Path(__file__).resolve().parents[2]


def _bad_files(tmp: Path, recording_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, text the error must contain)."""
    foreign = tmp / "notes.kvtrace"
    foreign.write_text("this is not a recording\n" * 10)
    empty = tmp / "empty.kvtrace"
    empty.write_bytes(b"")
    corrupt = tmp / "corrupt.kvtrace"
    data = bytearray(recording_path.read_bytes())
    data[8:12] = b"\xff\xff\xff\xff"  # format version field
    corrupt.write_bytes(bytes(data))
    future = tmp / "future.kvtrace"
    RecordingWriter(future, {"protocol": PROTOCOL_VERSION + 1}).close()
    nosteps = tmp / "nosteps.kvtrace"
    RecordingWriter(nosteps, {}).close()
    return {
        "missing": (tmp / "missing.kvtrace", "no such recording"),
        "foreign": (foreign, "not a kvscope recording"),
        "empty": (empty, "not a kvscope recording"),
        "corrupt": (corrupt, "recording format"),
        "protocol": (future, f"event protocol {PROTOCOL_VERSION + 1}"),
        "nosteps": (nosteps, "no engine steps"),
    }


def test_bad_files_give_clear_errors(tmp_path, recording_path, capsys, app):  # noqa: ANN001
    for name, (path, text) in _bad_files(tmp_path, recording_path).items():
        with pytest.raises(InspectError, match=text):
            open_recording(path)
        # --screenshot: exit code 2 and the message on stderr, no PNG.
        out = tmp_path / f"{name}.png"
        assert run(recording=str(path), screenshot=str(out)) == 2, name
        err = capsys.readouterr().err
        assert text in err and "Traceback" not in err
        assert not out.exists()


def test_truncated_recording_opens_with_a_warning(tmp_path, batches, window):  # noqa: ANN001
    path = write_recording(tmp_path / "cut.kvtrace", batches[:120], chunk_steps=16)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])  # killed writer: no index, a torn frame
    rec, notes = open_recording(path)
    assert notes and "truncated" in notes[0]
    window.open_replay(rec, path.name)
    for note in notes:
        window.show_error(note)
    assert window.banner.isVisible() and "truncated" in window.banner.text()
    assert 0 < window.replay.num_steps < 120


def test_step_out_of_range(tmp_path, recording_path, capsys, app):  # noqa: ANN001
    assert run(recording=str(recording_path), screenshot=str(tmp_path / "x.png"),
               step=10_000) == 2
    assert "step 10000 is outside" in capsys.readouterr().err


def test_cli_screenshot_headless(tmp_path, recording_path, artifacts):  # noqa: ANN001
    """The real command, in a fresh process: renders offscreen, exits 0, writes the PNG."""
    out = artifacts / "inspector_cli_screenshot.png"
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    r = subprocess.run([sys.executable, "-m", "kvscope.engine.cli", "inspect", str(recording_path),
                        "--screenshot", str(out), "--step", "150"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 20_000 and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A wrong endpoint, with --screenshot: a clear message and a non-zero exit, no hang.
    r = subprocess.run([sys.executable, "-m", "kvscope.engine.cli", "inspect", "--connect",
                        "tcp://127.0.0.1:1", "--screenshot", str(tmp_path / "l.png"),
                        "--wait", "0.5"], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=HANG_S)
    assert r.returncode == 3 and "no state from tcp://127.0.0.1:1" in r.stderr


def test_bundled_sample_opens(app, window):  # noqa: ANN001
    from kvscope.inspector.app import SAMPLE

    assert SAMPLE.stat().st_size < 1 << 20
    rec, notes = open_recording(SAMPLE)
    assert notes == [] and len(rec.steps) >= 100
    window.open_replay(rec, SAMPLE.name)
    window.replay.to_end()
    assert window.model.state.seqs and window.model.state.canonical() == rec.state_at(
        rec.steps[-1]).canonical()


def test_inspector_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['triton'] = None\n"
        "import kvscope.inspector.app, kvscope.inspector.window, kvscope.inspector.sources.live\n"
        "import kvscope.inspector.sources.replay, kvscope.inspector.views.block_map\n"
        "import kvscope.engine.commands.inspect\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=HANG_S, env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert r.returncode == 0, r.stderr
