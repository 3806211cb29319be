"""The inspector's entry point: build the QApplication and the window for one source.

Interactive, an error (unreadable file, bad endpoint, protocol mismatch) shows in the
window's banner. With ``screenshot`` it renders offscreen, saves a PNG and returns an
exit code: 0 saved, 2 bad input (message on stderr), 3 no data from a live endpoint.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from importlib.resources import files
from pathlib import Path
from typing import Any

from kvscope.inspector.errors import InspectError

# assets/ ships as the package kvscope (setup.py): found the same way in a
# checkout (editable install) and in an installed wheel.
SAMPLE = Path(str(files("kvscope") / "sample.kvtrace"))


def open_recording(path: str | os.PathLike) -> tuple[Any, list[str]]:
    """(Recording, warnings as text). Raises InspectError with a clear message."""
    from kvscope.engine.events.wire.recording import Recording, RecordingError, RecordingWarning

    p = Path(path)
    if not p.is_file():
        raise InspectError(f"{p}: no such recording file")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RecordingWarning)
        try:
            rec = Recording(p)
        except (RecordingError, ValueError, OSError) as e:
            raise InspectError(str(e)) from None
    notes = [str(w.message) for w in caught if issubclass(w.category, RecordingWarning)]
    if not rec.steps:
        raise InspectError(f"{p}: the recording holds no engine steps")
    return rec, notes


def make_app(offscreen: bool = False) -> Any:
    if offscreen:
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
    from PySide6.QtWidgets import QApplication

    from kvscope.inspector import gui_gc, theme

    app = QApplication.instance() or QApplication(sys.argv[:1])
    app.setApplicationName("kvscope inspector")
    theme.apply(app)
    gui_gc.install()  # the live sources' threads must never free a Qt object
    return app


def run(recording: str | None = None, connect: str | None = None,
        screenshot: str | None = None, step: int | None = None, wait_s: float = 5.0,
        snapshot_endpoint: str | None = None, keys: str | None = None) -> int:
    app = make_app(offscreen=screenshot is not None)
    from kvscope.inspector.window import MainWindow

    win = MainWindow()
    try:
        if connect:
            code = _open_live(app, win, connect, snapshot_endpoint, screenshot, wait_s, keys)
        else:
            code = _open_replay(app, win, recording, screenshot, step)
    except InspectError as e:
        if screenshot is not None:
            print(f"kvscope inspect: {e}", file=sys.stderr)
            return 2
        win.show_error(str(e))
        code = None
    if code is not None:
        return code
    win.show()
    return int(app.exec())


def _open_replay(app: Any, win: Any, recording: str | None, screenshot: str | None,
                 step: int | None) -> int | None:
    from kvscope.engine.events.wire.recording import RecordingWarning

    path = Path(recording) if recording else SAMPLE
    rec, notes = open_recording(path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RecordingWarning)  # rec.damage says it, once
        win.open_replay(rec, path.name)  # reads every batch once (the timeline)
    if rec.damage is not None:
        if not win.replay.num_steps:
            raise InspectError(rec.damage)
        notes.append(rec.damage)
        if screenshot is not None:
            print(f"kvscope inspect: partial: {rec.damage}", file=sys.stderr)
    for note in notes:
        win.show_error(note)
    if step is not None:
        lo, hi = int(win.replay.steps[0]), int(win.replay.steps[-1])  # the readable ones
        if not lo <= step <= hi:
            raise InspectError(f"step {step} is outside {path.name} (steps {lo}..{hi})")
        win.replay.seek_step(step)
    elif screenshot is not None:
        win.replay.to_end()
    if screenshot is None:
        return None
    return _save(app, win, screenshot)


def _open_live(app: Any, win: Any, endpoint: str, snapshot_endpoint: str | None,
               screenshot: str | None, wait_s: float,
               keys: str | None = None) -> int | None:
    from kvscope.inspector.sources.live import LiveSource

    # Raises InspectError on a malformed endpoint or unreadable keys.
    live = LiveSource(endpoint, win.model, snapshot_endpoint=snapshot_endpoint, keys=keys)
    win.attach_live(live, endpoint)
    live.start()
    if screenshot is None:
        app.aboutToQuit.connect(live.stop)
        return None
    # watch the stream for wait_s, not only until its first state: a screenshot taken the
    # moment the snapshot lands has a page table but no history (empty timelines and
    # lifecycles, 0 events/s), which reads as a stream that does not move
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        app.processEvents()
        time.sleep(0.02)
    app.processEvents()
    live.stop()
    if not live.has_state:
        print(f"kvscope inspect: no state from {endpoint} within {wait_s:g} s "
              f"({live.status_text()}); is an engine publishing there?", file=sys.stderr)
        return 3
    return _save(app, win, screenshot)


def _save(app: Any, win: Any, path: str) -> int:
    win.resize(1600, 1000)
    win.show()
    for _ in range(3):
        app.processEvents()
    try:
        win.export_png(path)
    except OSError as e:
        print(f"kvscope inspect: {e}", file=sys.stderr)
        return 2
    print(f"saved {path}")
    return 0
