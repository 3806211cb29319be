"""``kvscope inspect --connect-vllm / --listen-vllm / x.vllmtrace``: the vLLM-stream view.

A window of its own (``inspector.views.vllm_prefix``): a vLLM-format stream carries the
prefix-cache index only, so the main window's block map, block tables and sequence views
have nothing to draw from it. Exit codes as ``inspector.app``: 0 saved, 2 bad input,
3 no data from a live endpoint within ``wait_s``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from kvscope.inspector.errors import InspectError


def run_vllm(*, endpoint: str | None = None, bind: bool = False,
             replay_endpoint: str | None = None, topic: str = "",
             record_path: str | None = None, recording: str | None = None,
             screenshot: str | None = None, wait_s: float = 5.0,
             until_seq: int | None = None) -> int:
    """``until_seq`` (replay only, ``--step``): show the state after that batch seq."""
    from kvscope.inspector.app import make_app

    app = make_app(offscreen=screenshot is not None)
    from PySide6.QtCore import QTimer

    from kvscope.inspector.sources.vllm import VllmLiveSource, load_vllm_recording
    from kvscope.inspector.views.vllm_prefix import make_view

    try:
        if recording is not None:
            cache, bad = load_vllm_recording(recording, until_seq)
            view = make_view(lambda: cache)
            note = f" ({bad} undecodable messages skipped)" if bad else ""
            upto = f" up to seq {cache.last_seq}" if until_seq is not None else ""
            view.refresh(f"replay of {recording}: {cache.batches} batches{upto}{note}")
            if screenshot is not None:
                return _save(app, view, screenshot)
            view.show()
            return int(app.exec())
        assert endpoint is not None
        live = VllmLiveSource(endpoint, bind=bind, replay_endpoint=replay_endpoint,
                              topic=topic, record_path=record_path)
    except InspectError as e:
        print(f"kvscope inspect: {e}", file=sys.stderr)
        return 2
    view = make_view(lambda: live.cache)
    live.start()

    def tick() -> None:
        live.drain()
        st = live.status()
        err = f", {st['errors']} bad messages ({st['last_error']})" if st["errors"] else ""
        rec = f", recording {st['recorded']} messages" if st["recorded"] is not None else ""
        view.refresh(f"{st['where']}: {st['batches']} batches, last seq {st['last_seq']}, "
                     f"gaps {st['gaps']} (missed {st['missed']}), restarts "
                     f"{st['restarts']}{err}{rec}")

    if screenshot is not None:
        # wait for the first batch, then until the stream is quiet for a second
        end = time.monotonic() + wait_s
        quiet = None
        while time.monotonic() < end and (quiet is None or time.monotonic() - quiet < 1.0):
            app.processEvents()
            time.sleep(0.05)
            if live.drain():
                quiet = time.monotonic()
        tick()
        live.stop()
        if live.cache.batches == 0:
            print(f"kvscope inspect: no vLLM events from {endpoint} within {wait_s:g} s; "
                  f"is a publisher there (and does it bind, or connect: see --listen-vllm)?",
                  file=sys.stderr)
            return 3
        return _save(app, view, screenshot)
    timer = QTimer()
    timer.timeout.connect(tick)
    timer.start(100)
    app.aboutToQuit.connect(live.stop)
    view.resize(1400, 900)
    view.show()
    return int(app.exec())


def _save(app: Any, view: Any, path: str) -> int:
    view.resize(1400, 900)
    view.show()
    for _ in range(3):
        app.processEvents()
    if not view.grab().save(path):
        print(f"kvscope inspect: cannot write {path}", file=sys.stderr)
        return 2
    print(f"saved {path}")
    return 0
