"""FleetWindow: several replicas side by side, each with its block map and timelines,
live (one LiveSource per replica) or replayed (several recordings on one time axis).

Live, a router's address (``kvscope inspect --connect http://ROUTER``) is resolved to its
replicas' event endpoints, and the router's per-replica figures (requests routed, prefix
hit rate from the replicas' own ``cached_tokens``, predicted cached tokens, in rotation)
are polled once a second on a background thread and shown in each panel's header.

Replay: recordings made at the same time (``kvscope serve --data-parallel-size N
--record run.kvtrace`` writes one per replica) share the wall clock their batches carry;
one slider and one play button move every panel to the last step at or before the same
instant. Each panel keeps its own ReplayController (the single-replica seek logic).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QPushButton,
    QSlider,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from kvscope.engine.events.stats import StepStats
from kvscope.inspector.errors import InspectError
from kvscope.inspector.model import InspectorModel
from kvscope.inspector.views.block_map import BlockMapView
from kvscope.inspector.views.timelines import TimelinesView

TICK_MS = 33
ROUTER_POLL_S = 1.0
SLIDER_STEPS = 1000


def resolve_router(url: str, timeout: float = 5.0) -> list[dict[str, Any]]:
    """The replicas a router routes to (its /router/replicas), with their event endpoints."""
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/router/replicas", timeout=timeout)
        r.raise_for_status()
        replicas = r.json()["replicas"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        raise InspectError(f"{url}: not a kvscope router ({type(e).__name__}: {e})") from None
    if not replicas or not all(x.get("events") for x in replicas):
        raise InspectError(f"{url}: the router's replicas publish no event stream")
    return replicas


def hit_rate_text(state: Any) -> str:
    s = StepStats.read(state.stats)
    q, h = s.query_tokens, s.hit_tokens or 0
    if not q:
        return "prefix hits —"
    return f"prefix hits {h / q:.1%} ({h:,}/{q:,} tokens)"


class ReplicaPanel(QWidget):
    """One replica: a header, its block map over its timelines."""

    def __init__(self, name: str, key: str | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.name = name
        self.key = key or name  # the replica's URL in the router's figures
        self.model = InspectorModel()
        self.header = QLabel(f"<b>{name}</b>")
        self.header.setTextFormat(Qt.TextFormat.RichText)
        self.router_line = QLabel("")
        self.block_map = BlockMapView(self.model)
        self.timelines = TimelinesView(self.model, costs=False)  # no lifecycle index here
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(self.block_map)
        split.addWidget(self.timelines)
        split.setSizes([500, 400])
        lay = QVBoxLayout(self)
        lay.setContentsMargins(2, 2, 2, 2)
        lay.addWidget(self.header)
        lay.addWidget(self.router_line)
        lay.addWidget(split, 1)
        self.model.state_changed.connect(self.refresh_header)
        self.source_text = ""

    def refresh_header(self) -> None:
        self.header.setText(f"<b>{self.name}</b> · {self.source_text} · "
                            f"{hit_rate_text(self.model.state)}")

    def set_router_figures(self, r: dict[str, Any] | None) -> None:
        if r is None:
            self.router_line.setText("")
            return
        rate = r.get("hit_rate")
        up = "in rotation" if r.get("in_rotation") else "OUT of rotation"
        self.router_line.setText(
            f"router: {up} · {r.get('routed', 0)} routed · hit rate "
            f"{'—' if rate is None else f'{rate:.1%}'} · predicted/actual cached "
            f"{r.get('predicted_cached_tokens', 0)}/{r.get('actual_cached_tokens', 0)} · "
            f"load {r.get('load', 0)}")


class FleetWindow(QMainWindow):
    def __init__(self, names: list[str], keys: list[str] | None = None) -> None:
        super().__init__()
        self.setWindowTitle("kvscope inspector — fleet")
        self.resize(1800, 1000)
        self.panels = [ReplicaPanel(n, k) for n, k in zip(names, keys or names, strict=True)]
        self.banner = QLabel()
        self.banner.setWordWrap(True)
        self.banner.hide()
        row = QSplitter(Qt.Orientation.Horizontal)
        for p in self.panels:
            row.addWidget(p)
        central = QWidget()
        self._layout = QVBoxLayout(central)
        self._layout.setContentsMargins(4, 4, 4, 4)
        self._layout.addWidget(self.banner)
        self._layout.addWidget(row, 1)
        self.setCentralWidget(central)
        self.sources: list[Any] = []
        self.replay: FleetReplay | None = None
        self._router_url: str | None = None
        self._router_figures: dict[str, dict[str, Any]] = {}
        self._router_error = ""
        self._stop = threading.Event()
        self._router_timer = QTimer(self)
        self._router_timer.setInterval(int(ROUTER_POLL_S * 1000))
        self._router_timer.timeout.connect(self._show_router)

    def show_error(self, text: str) -> None:
        self.banner.setText(f"⚠  {text}")
        self.banner.show()

    # ------------------------------------------------------------------ live
    def attach_live(self, endpoints: list[tuple[str, str | None]],
                    keys: str | None = None) -> None:
        from kvscope.inspector.sources.live import LiveSource

        for panel, (endpoint, snap) in zip(self.panels, endpoints, strict=True):
            live = LiveSource(endpoint, panel.model, snapshot_endpoint=snap, keys=keys)
            panel.timelines.follow.setChecked(True)
            panel.source_text = f"live {endpoint}"
            panel.refresh_header()
            self.sources.append(live)

    def start(self) -> None:
        for s in self.sources:
            s.start()

    def stop(self) -> None:
        self._stop.set()
        for s in self.sources:
            s.stop()

    @property
    def has_state(self) -> bool:
        return all(s.has_state for s in self.sources)

    def follow_router(self, url: str) -> None:
        """Poll the router's per-replica figures on a thread; show them at 1 Hz."""
        import httpx

        self._router_url = url.rstrip("/")

        def poll() -> None:
            while not self._stop.is_set():
                try:
                    r = httpx.get(self._router_url + "/router/replicas", timeout=2.0)
                    figures = {x["url"]: x for x in r.json()["replicas"]}
                    self._router_figures, self._router_error = figures, ""
                except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                    self._router_error = f"router {self._router_url}: {e}"
                self._stop.wait(ROUTER_POLL_S)

        threading.Thread(target=poll, name="kvscope-fleet-router", daemon=True).start()
        self._router_timer.start()

    def fetch_router_now(self) -> None:
        """One synchronous poll (for a screenshot, which cannot wait for the thread)."""
        import httpx

        if self._router_url:
            try:
                r = httpx.get(self._router_url + "/router/replicas", timeout=2.0)
                self._router_figures = {x["url"]: x for x in r.json()["replicas"]}
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                self._router_error = f"router {self._router_url}: {e}"
            self._show_router()

    def _show_router(self) -> None:
        for p in self.panels:
            p.set_router_figures(self._router_figures.get(p.key))
        if self._router_error:
            self.show_error(self._router_error)

    # ---------------------------------------------------------------- replay
    def open_replays(self, recordings: list[Any], labels: list[str]) -> None:
        from kvscope.inspector.sources.replay import ReplayController

        controllers = []
        for panel, rec, label in zip(self.panels, recordings, labels, strict=True):
            c = ReplayController(rec, panel.model)
            c.error.connect(self.show_error)
            panel.source_text = f"replay {label}"
            controllers.append(c)
        self.replay = FleetReplay(controllers)
        self._layout.addWidget(self.replay.bar)
        self.replay.seek_time(self.replay.t0)


class FleetReplay:
    """One clock over several ReplayControllers: each shows its last step at or before
    the clock (a replica that has not started yet shows its first step)."""

    def __init__(self, controllers: list[Any]) -> None:
        self.controllers = controllers
        starts = [float(c._times[0]) for c in controllers if c.num_steps]
        ends = [float(c._times[-1]) for c in controllers if c.num_steps]
        self.t0, self.t1 = (min(starts), max(ends)) if starts else (0.0, 0.0)
        self.clock = self.t0
        self._last_tick = 0.0
        self.timer = QTimer()
        self.timer.setInterval(TICK_MS)
        self.timer.timeout.connect(self._tick)
        self.bar = QWidget()
        self.play_button = QPushButton("Play")
        self.play_button.clicked.connect(self.toggle)
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.slider.setRange(0, SLIDER_STEPS)
        self.slider.sliderMoved.connect(
            lambda v: self.seek_time(self.t0 + (self.t1 - self.t0) * v / SLIDER_STEPS))
        self.position = QLabel("")
        lay = QHBoxLayout(self.bar)
        lay.addWidget(self.play_button)
        lay.addWidget(self.slider, 1)
        lay.addWidget(self.position)

    def index_at(self, c: Any, t: float) -> int:
        return max(int(np.searchsorted(c._times, t, side="right")) - 1, 0)

    def seek_time(self, t: float) -> None:
        self.clock = min(max(t, self.t0), self.t1)
        for c in self.controllers:
            if c.num_steps:
                i = self.index_at(c, self.clock)
                if i > c.index >= 0:
                    c._advance(i - c.index)  # forward: apply batches, no keyframe
                elif i != c.index:
                    c.seek_index(i)
        self._show_position()

    def to_end(self) -> None:
        self.seek_time(self.t1)

    def _show_position(self) -> None:
        span = self.t1 - self.t0
        self.slider.blockSignals(True)
        self.slider.setValue(int(SLIDER_STEPS * (self.clock - self.t0) / span) if span else 0)
        self.slider.blockSignals(False)
        steps = ", ".join(str(c.step) for c in self.controllers)
        self.position.setText(f"+{self.clock - self.t0:.2f} s · steps {steps}")

    def toggle(self) -> None:
        if self.timer.isActive():
            self.timer.stop()
            self.play_button.setText("Play")
        else:
            if self.clock >= self.t1:
                self.seek_time(self.t0)
            self._last_tick = time.monotonic()
            self.timer.start()
            self.play_button.setText("Pause")

    def _tick(self) -> None:
        now = time.monotonic()
        self.seek_time(self.clock + (now - self._last_tick))
        self._last_tick = now
        if self.clock >= self.t1:
            self.toggle()


# ----------------------------------------------------------------- entry point
def run_fleet(recordings: list[str], connect: list[str], screenshot: str | None = None,
              wait_s: float = 5.0, events_keys: str | None = None) -> int:
    """``kvscope inspect`` with several recordings, several ``--connect`` endpoints or a
    router's http address (``events_keys``: CURVE client keys for every live stream).
    Exit codes as ``inspector.app.run``."""
    import sys

    from kvscope.inspector.app import make_app

    app = make_app(offscreen=screenshot is not None)
    try:
        win = _build(recordings, connect, events_keys)
    except InspectError as e:
        print(f"kvscope inspect: {e}", file=sys.stderr)
        return 2
    if win.sources:
        win.start()
        app.aboutToQuit.connect(win.stop)
    if screenshot is None:
        win.show()
        return int(app.exec())
    if win.sources:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not win.has_state:
            app.processEvents()
            time.sleep(0.02)
        app.processEvents()
        win.fetch_router_now()
        win.stop()
        if not win.has_state:
            print(f"kvscope inspect: no state from every replica within {wait_s:g} s",
                  file=sys.stderr)
            return 3
    elif win.replay is not None:
        win.replay.to_end()
    win.resize(1800, 1000)
    win.show()
    for _ in range(3):
        app.processEvents()
    if not win.grab().save(screenshot, "PNG"):
        print(f"kvscope inspect: could not write PNG {screenshot}", file=sys.stderr)
        return 2
    print(f"saved {screenshot}")
    return 0


def _build(recordings: list[str], connect: list[str],
           events_keys: str | None = None) -> FleetWindow:
    from kvscope.inspector.app import open_recording

    if recordings and connect:
        raise InspectError("give recordings or --connect endpoints, not both")
    if recordings:
        recs, names = [], []
        for path in recordings:
            rec, _notes = open_recording(path)
            recs.append(rec)
            names.append(path.rsplit("/", 1)[-1])
        win = FleetWindow(names)
        win.open_replays(recs, names)
        return win
    router = None
    endpoints: list[tuple[str, str | None]] = []
    names, keys = [], []
    for c in connect:
        if c.startswith(("http://", "https://")):
            router = c
            for x in resolve_router(c):
                endpoints.append((x["events"], None))
                names.append(f"{x['name']} {x['url']}")
                keys.append(x["url"])
        else:
            endpoints.append((c, None))
            names.append(c)
            keys.append(c)
    win = FleetWindow(names, keys)
    win.attach_live(endpoints, events_keys)
    if router is not None:
        win.follow_router(router)
    return win
