"""Live mode against a real EventStream publishing on loopback: late join converges to
the publisher's cache, a killed and restarted publisher is survived, bad endpoints and
foreign publishers give a clear message."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq

from kvscope.engine.bench.synthetic import SyntheticCache
from kvscope.engine.events import PROTOCOL_VERSION
from kvscope.engine.events.wire import EventStream
from kvscope.inspector.errors import InspectError
from kvscope.inspector.sources.live import LiveSource
from tests.waiting import HANG_MS, HANG_S


class Engine:
    """A SyntheticCache stepping into an EventStream on a thread (a stand-in engine)."""

    def __init__(self, endpoint: str, snapshot_endpoint: str, seed: int) -> None:
        self.cache = SyntheticCache(seed=seed, gpu_blocks=512, cpu_blocks=128, max_running=12,
                                    arrival_rate=0.9)
        # wired as LLMEngine wires it: snapshots from the cache, steps under the lock
        self.stream = EventStream(endpoint=endpoint, snapshot_endpoint=snapshot_endpoint,
                                  heartbeat_s=0.2, snapshot_fn=self.cache.canonical,
                                  engine_lock=threading.Lock())
        self.step = -1
        self._go = threading.Event()
        self._done = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def run_steps(self, n: int, interval: float = 0.004) -> None:
        """Publish ``n`` more steps on a background thread (``wait()`` for them), one every
        ``interval`` s like a real engine's steps (pacing only: nothing waits on it)."""
        self._done.clear()

        def loop() -> None:
            for _ in range(n):
                if self._stop.is_set():
                    break
                with self.stream.engine_lock:
                    self.step += 1
                    stats = self.cache.step(self.stream.sink)
                    self.stream.end_step(self.step, stats)
                time.sleep(interval)
            self._done.set()

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def wait(self) -> None:
        assert self._done.wait(HANG_S)

    def close(self) -> None:
        self._stop.set()  # a run still publishing ends before its stream closes
        if self._thread is not None:
            self._thread.join(HANG_S)
        self.stream.close()


class WatchClock:
    """Stands in for ``inspector.app``'s clock in a timed watch (``--wait S``): it stands
    still until ``ready()`` (the events the test needs were drawn), then runs as the real
    one. The watch so lasts S seconds from when they arrived, however long a loaded box
    took to bring them; ``hang_s`` of real time without them only stops a stuck test."""

    def __init__(self, ready, hang_s: float = HANG_S) -> None:  # noqa: ANN001
        self.ready = ready
        self.hang_end = time.monotonic() + hang_s
        self.since: float | None = None  # real time at which ready() first held
        self.sleep = time.sleep

    def monotonic(self) -> float:
        now = time.monotonic()
        if self.since is None and (self.ready() or now > self.hang_end):
            self.since = now
        return 0.0 if self.since is None else now - self.since


def joined(live: LiveSource) -> bool:
    """The live source has its first snapshot: every later batch reaches the view (live,
    or by replay if it went missing)."""
    live.tick()
    return live.sub.status != "waiting"


def _converged(live: LiveSource, engine: Engine) -> bool:
    live.tick()
    return (live.sub.last_seq == engine.stream.seq
            and live.model.state.canonical() == engine.cache.canonical())


@pytest.fixture
def endpoints():
    """Two free loopback ports (the publisher binds them again after a restart)."""
    ctx = zmq.Context()
    socks = [ctx.socket(zmq.PUB) for _ in range(2)]
    eps = []
    for s in socks:
        s.bind("tcp://127.0.0.1:*")
        eps.append(s.getsockopt_string(zmq.LAST_ENDPOINT))
    for s in socks:
        s.close(0)
    ctx.term()
    return eps


def test_late_join_converges_and_survives_restart(window, qtbot, endpoints, artifacts):  # noqa: ANN001
    pub, snap = endpoints
    engine = Engine(pub, snap, seed=1)
    engine.run_steps(60)
    engine.wait()  # the inspector joins late: 60 steps already published
    live = LiveSource(pub, window.model, snapshot_endpoint=snap)
    window.attach_live(live, pub)
    live.start()
    try:
        qtbot.waitUntil(lambda: joined(live), timeout=HANG_MS)
        engine.run_steps(120)
        engine.wait()
        qtbot.waitUntil(lambda: _converged(live, engine), timeout=HANG_MS)
        # connected: a heartbeat or batch heard within stale_after_s (3 s); on a loaded box
        # the subscriber's thread may be late to hear one, so wait for it (never for time)
        qtbot.waitUntil(lambda: (live.tick(), live.sub.status == "connected"
                                 and not window.banner.isVisible())[1], timeout=HANG_MS)
        rows = {r[0] for r in window.sequences.visible_rows()}
        assert rows == set(engine.cache.canonical()["seqs"])
        assert window.model.timeline.n > 0  # batches since joining reached the timeline
        assert "live" in window.status_labels["source"].text()
        qtbot.wait(50)
        window.export_png(artifacts / "inspector_live.png")

        engine.close()  # the engine dies: the window keeps its last frame, says so
        frame = window.model.state.canonical()
        qtbot.waitUntil(lambda: (live.tick(), live.sub.status == "stale")[1],
                        timeout=HANG_MS)
        assert window.banner.isVisible() and "silent" in window.banner.text()
        assert window.model.state.canonical() == frame

        engine = Engine(pub, snap, seed=2)  # a new engine on the same endpoints
        engine.run_steps(80)
        engine.wait()
        qtbot.waitUntil(lambda: _converged(live, engine), timeout=HANG_MS)
        assert live.sub.restarts >= 1 and live.sub.epoch == engine.stream.epoch
        assert not window.banner.isVisible()
        window.export_png(artifacts / "inspector_live_after_restart.png")
    finally:
        live.stop()
        engine.close()


def test_flood_keeps_the_gui_responsive(window, qtbot, endpoints):  # noqa: ANN001
    """Publishing with no pause: each GUI tick stays short and the view still converges."""
    pub, snap = endpoints
    engine = Engine(pub, snap, seed=5)
    live = LiveSource(pub, window.model, snapshot_endpoint=snap)
    window.attach_live(live, pub)
    live.start()
    try:
        engine.run_steps(1500, interval=0.0)
        worst = 0.0
        while not engine._done.is_set():
            t = time.perf_counter()
            live.tick()
            worst = max(worst, time.perf_counter() - t)
            qtbot.wait(5)
        qtbot.waitUntil(lambda: _converged(live, engine), timeout=HANG_MS)
        print(f"worst GUI tick during flood: {worst * 1000:.1f} ms")
    finally:
        live.stop()
        engine.close()


def test_nobody_publishing_says_so(window, qtbot, endpoints, monkeypatch):  # noqa: ANN001
    monkeypatch.setattr("kvscope.inspector.sources.live.NO_ANSWER_S", 0.3)
    live = LiveSource(endpoints[0], window.model, snapshot_endpoint=endpoints[1])
    window.attach_live(live, endpoints[0])
    live.start()
    try:
        qtbot.waitUntil(lambda: window.banner.isVisible(), timeout=HANG_MS)
        assert "no kvscope publisher answering" in window.banner.text()
        assert "waiting" in window.status_labels["source"].text()
    finally:
        live.stop()


def test_protocol_mismatch_is_reported(window, qtbot, endpoints):  # noqa: ANN001
    """A publisher speaking a future protocol on both sockets: the banner names it."""
    FUTURE = PROTOCOL_VERSION + 1  # noqa: N806
    ctx = zmq.Context()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind(endpoints[0])
    router.bind(endpoints[1])
    live = LiveSource(endpoints[0], window.model, snapshot_endpoint=endpoints[1])
    window.attach_live(live, endpoints[0])
    live.start()
    try:
        def answer() -> bool:
            if router.poll(10):
                ident, *_ = router.recv_multipart()
                router.send_multipart([ident, msgpack.packb(
                    {"v": FUTURE, "type": "snapshot", "epoch": "x", "seq": 1, "step": 0,
                     "state": {}})])
            pub.send_multipart([b"kv", (1).to_bytes(8, "big"), msgpack.packb(
                {"v": FUTURE, "type": "heartbeat", "epoch": "x", "seq": 1, "time": 0.0})])
            # the reason, not any banner: on a loaded box "no publisher answering" (after
            # NO_ANSWER_S, 3 s) may show before the first message is read
            return window.banner.isVisible() and "protocol version" in window.banner.text()

        qtbot.waitUntil(answer, timeout=HANG_MS)
        assert f"protocol version {FUTURE}" in window.banner.text()
        assert not live.has_state
    finally:
        live.stop()
        pub.close(0)
        router.close(0)
        ctx.term()


def test_keys_a_keyed_engine_shows_to_the_keyed_inspector_only(window, qtbot, tmp_path):  # noqa: ANN001
    """An engine publishing with CURVE keys: an inspector without them gets nothing and
    its banner says keys are needed; with them (``--keys``) it draws the engine's cache."""
    from kvscope.engine.events.wire.keys import make_keys

    keys = tmp_path / "keys"
    make_keys(keys)
    cache = SyntheticCache(seed=5, gpu_blocks=128, cpu_blocks=32, max_running=6)
    stream = EventStream("tcp://127.0.0.1:0", heartbeat_s=0.2, snapshot_fn=cache.canonical,
                         engine_lock=threading.Lock(), keys=keys)
    with stream.engine_lock:
        for _ in range(20):
            stats = cache.step(stream.sink)
            stream.end_step(cache.step_no, stats)
    blind = LiveSource(stream.endpoint, window.model, snapshot_endpoint=stream.snapshot_endpoint)
    window.attach_live(blind, stream.endpoint)
    blind.start()
    try:
        # the reason, not any banner: on a loaded box "no publisher answering" (after
        # NO_ANSWER_S, 3 s) may show before the failed handshake is seen
        qtbot.waitUntil(lambda: window.banner.isVisible()
                        and "requires keys" in window.banner.text(), timeout=HANG_MS)
        assert "requires keys" in window.banner.text() and "kvscope keys" in window.banner.text()
        assert not blind.has_state
    finally:
        blind.stop()
    keyed = LiveSource(stream.endpoint, window.model, snapshot_endpoint=stream.snapshot_endpoint,
                       keys=str(keys))
    window.attach_live(keyed, stream.endpoint)
    keyed.start()
    try:
        def drawn() -> bool:
            keyed.tick()
            return keyed.sub.last_seq == stream.seq and \
                window.model.state.canonical() == cache.canonical()

        qtbot.waitUntil(drawn, timeout=HANG_MS)
        assert keyed.sub.problem is None
    finally:
        keyed.stop()
        stream.close()


@pytest.mark.parametrize("endpoint", ["tcp://nowhere", "bogus://x:1", "tcp://127.0.0.1:notaport"])
def test_malformed_endpoint_is_a_clear_error(endpoint, window):  # noqa: ANN001
    with pytest.raises(InspectError, match="cannot connect to"):
        LiveSource(endpoint, window.model)


def test_column_frames_reach_the_view_as_the_per_event_path_draws_them(qapp, qtbot):  # noqa: ANN001
    """Protocol 3 into the live inspector: a bulk step arrives as one frame of columns,
    the subscriber's mirror applies it with arrays (never handing it to the per-event
    reference), and what the view shows (state, block map, event log) equals the same
    stream applied event by event."""
    from kvscope.engine.events import KVState
    from kvscope.engine.events.analysis.lifecycle import LifecycleIndex
    from kvscope.inspector.model import InspectorModel
    from kvscope.inspector.views.block_map import BlockMapView, cell_codes
    from tests.events.test_wire_v3 import bulk

    batches = bulk(8)
    truth = KVState()  # the reference: every batch applied event by event
    model = InspectorModel()
    view = BlockMapView(model)
    qtbot.addWidget(view)
    with EventStream("tcp://127.0.0.1:0", engine_lock=threading.Lock(),
                     snapshot_fn=lambda: truth.snapshot()) as stream:
        live = LiveSource(stream.endpoint, model, snapshot_endpoint=stream.snapshot_endpoint)
        # a replay a loaded box serves late is waited for (a hang guard), not turned into
        # a resync after 2 s: the batches its snapshot covered would never reach on_apply
        live.sub.request_timeout_s = HANG_S
        seen: list[bool] = []  # per batch applied: it came as columns
        keep = live.sub.on_apply
        live.sub.on_apply = lambda b, s: (seen.append("columns" in b), keep(b, s))
        live.start()
        try:
            qtbot.waitUntil(lambda: joined(live), timeout=HANG_MS)
            for b in batches:
                with stream.engine_lock:
                    truth.apply({k: v for k, v in b.items() if k != "columns"})
                    for ev in b["events"]:
                        stream.sink.emit(**ev)
                    stream.end_step(b["step"], b["stats"])
            last = batches[-1]["step"]  # the frame shown holds the last step
            qtbot.waitUntil(lambda: (live.tick(), model.state.step == last)[1],
                            timeout=HANG_MS)
        finally:
            live.stop()
    assert sum(seen) >= len(batches) - 1, seen  # bulk steps: all but the first as columns
    assert live.sub.state.columns_refused == 0
    assert model.state.canonical() == truth.canonical()
    for mode in ("state", "owner", "age"):
        view.set_mode(mode)
        assert (view.cells("gpu") == cell_codes(truth, "gpu", mode=mode)).all(), mode
    # the log and the lifecycle read the frames' events: the same as the reference's
    ref_life = LifecycleIndex()
    for b in batches:
        ref_life.add(b)
    assert sorted(model.lifecycle.seqs) == sorted(ref_life.seqs)
    assert model.lifecycle.totals == ref_life.totals
    assert {sid: (s.status, s.blocks) for sid, s in model.lifecycle.seqs.items()} == {
        sid: (s.status, s.blocks) for sid, s in ref_life.seqs.items()}
    assert [ev["kind"] for _, ev in model.events][-5:] == [
        ev["kind"] for ev in batches[-1]["events"]][-5:]


def test_a_live_screenshot_shows_what_the_stream_brought_while_watching(  # noqa: ANN001
        window, qapp, endpoints, tmp_path, monkeypatch):
    """`kvscope inspect --connect E --screenshot P --wait S` watches the stream for S
    seconds before saving: the saved window has the batches since it joined (timelines,
    lifecycles), not only the snapshot's page table (which read as a stream that does not
    move: empty timelines, 0 events/s)."""
    from kvscope.inspector.app import _open_live

    pub, snap = endpoints
    engine = Engine(pub, snap, seed=3)
    engine.run_steps(1_000_000, interval=0.002)  # publishing throughout the watch
    # the watch's 5 s run from when the window has drawn batches since it joined: a
    # loaded box may take longer to join (and the engine may be slow), which must make
    # the test slower, never red; the batches drawn are what it waits for
    clock = WatchClock(lambda: window.model.timeline.n > 0)
    monkeypatch.setattr("kvscope.inspector.app.time", clock)
    try:
        t0 = time.monotonic()
        assert _open_live(qapp, window, pub, snap, str(tmp_path / "live.png"), 5.0) == 0
        assert time.monotonic() < clock.hang_end, "no batch drawn: the watch hung"
        # the whole watch, though the state came at once (a lower bound: a slow box only
        # makes it longer), and the batches after the snapshot were drawn
        assert clock.since is not None and time.monotonic() - clock.since >= 5.0
        assert time.monotonic() - t0 >= 5.0
        assert window.model.timeline.n > 0
        assert (tmp_path / "live.png").stat().st_size > 10_000
    finally:
        engine.close()


def test_a_recording_that_stopped_shows_in_the_banner(window, qtbot, endpoints, tmp_path):  # noqa: ANN001
    """Defect 7: the engine's recording stopped on a full disk (its file swapped for one
    open on /dev/full: the kernel's ENOSPC) while the live stream went on; every later
    batch's stats say so and the inspector's banner shows it."""
    pub, snap = endpoints
    cache = SyntheticCache(seed=3)
    stream = EventStream(endpoint=pub, snapshot_endpoint=snap, heartbeat_s=0.2,
                         snapshot_fn=cache.canonical, engine_lock=threading.Lock(),
                         record_path=str(tmp_path / "run.kvtrace"))
    live = LiveSource(pub, window.model, snapshot_endpoint=snap)
    window.attach_live(live, pub)
    live.start()
    step = 0

    def one_step() -> bool:
        nonlocal step
        with stream.engine_lock:
            stream.end_step(step, cache.step(stream.sink))
        step += 1
        return True

    try:
        qtbot.waitUntil(lambda: one_step() and joined(live), timeout=HANG_MS)
        assert not window.banner.isVisible()
        rec = stream.recorder
        with stream.engine_lock:
            assert stream.wait_idle(HANG_S)
            rec.flush()
            rec._file.close()
            rec._file = open("/dev/full", "wb")  # noqa: SIM115 - the writer owns it
        qtbot.waitUntil(lambda: one_step() and (live.tick(), window.banner.isVisible())[1],
                        timeout=HANG_MS)
        assert "recording stopped early" in window.banner.text()
        assert "No space left on device" in window.banner.text()
        assert live.sub.status == "connected"
    finally:
        live.stop()
        stream.close()
