"""`kvscope record --connect ... -o ... --duration S` writes a recording equal to what
the engine published."""

from __future__ import annotations

import threading

from kvscope.engine.bench.synthetic import SyntheticCache
from kvscope.engine.cli import main
from kvscope.engine.events.wire import EventStream, Recording
from tests.events.conftest import poll_until
from tests.waiting import HANG_S, wait_until


class _Clock:
    """The recorder's clock (its only use of time is --duration): it stands still until
    the test lets the duration run out, so how much gets recorded never depends on how
    fast the box is."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def test_record_cli_writes_what_was_published(tmp_path, capsys, monkeypatch):
    from kvscope.engine.commands import record
    from kvscope.engine.events.wire import subscriber

    clock, recorders = _Clock(), []

    class SeenSubscriber(subscriber.Subscriber):  # the recorder's, for the test to watch
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            # a replay that a loaded box serves late is waited for (a hang guard only),
            # not turned into a resync after 2 s: its snapshot would cover the steps the
            # recording must hold one by one
            self.request_timeout_s = HANG_S
            recorders.append(self)

    monkeypatch.setattr(record, "time", clock)
    monkeypatch.setattr(subscriber, "Subscriber", SeenSubscriber)
    out = tmp_path / "cli.kvtrace"
    gen, truth = SyntheticCache(seed=31), {}
    with EventStream("tcp://127.0.0.1:0", heartbeat_s=0.2, header={"model": "synthetic"},
                     snapshot_fn=gen.canonical, engine_lock=threading.Lock()) as stream:
        for step in range(30):  # history the recorder only gets as a snapshot
            with stream.engine_lock:
                stream.end_step(step, gen.step(stream.sink))
        truth[29] = gen.canonical()
        # the snapshot comes from the cache (gen) while the engine idles, once the stream
        # thread has handled every batch: exactly step 29
        assert stream.wait_idle(HANG_S)
        rc: list[int] = []
        cli = threading.Thread(target=lambda: rc.append(main([
            "record", "--connect", stream.endpoint, "--snapshot-endpoint",
            stream.snapshot_endpoint, "-o", str(out), "--duration", "5",
            "--keyframe-every-steps", "25"])))
        cli.start()
        poll_until([], lambda: out.exists())  # the first snapshot arrived
        for step in range(30, 130):
            with stream.engine_lock:
                stream.end_step(step, gen.step(stream.sink))
            truth[step] = gen.canonical()
        assert stream.wait_idle(HANG_S)  # all 130 steps are on the wire
        wait_until(lambda: recorders[0].last_seq == stream.seq, "the recorder's last batch")
        clock.now = 5.0  # the 5 s are up
        cli.join(HANG_S)
        assert not cli.is_alive()
    assert rc == [0]
    assert "recorded" in capsys.readouterr().out
    with Recording(out) as rec:
        assert rec.header["epoch"] == stream.epoch
        assert rec.header["source"] == stream.endpoint
        assert rec.header["model"] == "synthetic"  # the publisher's header, via snapshot
        assert rec.keyframe_steps[0] == 29
        assert rec.steps == list(range(30, 130))
        for step in (29, 30, 77, 100, 129):
            assert rec.state_at(step).canonical() == truth[step], step


def test_record_cli_without_publisher(tmp_path, capsys):
    rc = main(["record", "--connect", "tcp://127.0.0.1:1", "-o", str(tmp_path / "x"),
               "--duration", "0.3"])
    assert rc == 1 and "no snapshot" in capsys.readouterr().err
