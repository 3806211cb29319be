"""Recordings replay exactly (iteration and state_at), survive a killed writer and a
truncated file, and reject foreign or corrupt files with an error naming the file."""

from __future__ import annotations

import errno
import logging
import os
import random
import shutil
import struct

import pytest

from kvscope.engine.bench.synthetic import SyntheticCache
from kvscope.engine.events import PROTOCOL_VERSION, KVState
from kvscope.engine.events.sink import ListSink
from kvscope.engine.events.stats import StepStats
from kvscope.engine.events.wire import EventStream, Recording, RecordingError, RecordingWarning
from kvscope.engine.events.wire.codec import make_batch
from kvscope.engine.events.wire.recording import RecordingWriter
from tests.waiting import HANG_S, wait_until

STEPS = 240


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """A recording of STEPS synthetic steps and the true state after each step."""
    path = tmp_path_factory.mktemp("rec") / "run.kvtrace"
    gen, truth = SyntheticCache(seed=21), []
    header = {"engine": {"block_size": 16, "num_gpu_blocks": 128}, "model": "synthetic"}
    with EventStream(record_path=str(path), header=header, keyframe_every_steps=50,
                     snapshot_fn=gen.canonical) as s:
        for step in range(STEPS):
            stats = gen.step(s.sink)
            s.end_step(step, stats)
            truth.append(gen.canonical())
    return path, truth


def test_iteration_rebuilds_every_step(recorded):
    path, truth = recorded
    with Recording(path) as rec:
        assert rec.steps == list(range(STEPS)) and not rec.truncated
        assert rec.header["model"] == "synthetic" and rec.header["protocol"] == PROTOCOL_VERSION
        assert rec.header["engine"]["num_gpu_blocks"] == 128 and rec.header["epoch"]
        assert rec.keyframe_steps == [-1, 49, 99, 149, 199]
        st = KVState()
        for batch in rec:
            st.apply(batch)
            assert st.canonical() == truth[batch["step"]]


def test_state_at_random_steps(recorded):
    path, truth = recorded
    rng = random.Random(3)
    with Recording(path) as rec:
        for step in rng.sample(range(STEPS), 25) + [0, 49, 50, STEPS - 1]:
            assert rec.state_at(step).canonical() == truth[step], step
        assert rec.state_at(-1).canonical() == {"tiers": {}, "seqs": {}}
        assert rec.state_at(10**6).canonical() == truth[-1]
        with pytest.raises(RecordingError, match="no keyframe at or before step -5"):
            rec.state_at(-5)
        assert [b["step"] for b in rec.batches(start_step=100, end_step=104)] == [
            100, 101, 102, 103, 104]


def test_a_seeks_log_context_reuses_the_frames_state_at_decoded(recorded, monkeypatch):
    path, truth = recorded
    with Recording(path) as rec:
        decoded = []
        real = rec._decode_deltas
        monkeypatch.setattr(rec, "_decode_deltas", lambda off: decoded.append(off) or real(off))
        assert rec.state_at(190).canonical() == truth[190]
        n = len(decoded)
        assert n > 0
        context = list(rec.batches(start_step=160, end_step=190))  # the replay's log
        assert len(decoded) == n  # no frame decoded twice
        assert [b["step"] for b in context] == list(range(160, 191))
        assert rec.state_at(190).canonical() == truth[190]  # cached frames are not mutated


def test_killed_writer_leaves_a_readable_file(tmp_path):
    """No close(): no index. The reader rebuilds it by scanning and warns."""
    gen, sink, st = SyntheticCache(seed=5), ListSink(), KVState()
    path = tmp_path / "killed.kvtrace"
    writer = RecordingWriter(path, keyframe_every_steps=30, chunk_steps=8)
    writer.keyframe(st, 0)
    truth = []
    for step in range(100):
        stats = gen.step(sink)
        batch = make_batch("e", step + 1, step, 0.0, sink.drain(), stats)
        st.apply(batch)
        writer.add(batch, st)
        truth.append(gen.canonical())
    copy = tmp_path / "copy.kvtrace"
    shutil.copy(path, copy)  # the file as a crash leaves it (whole frames were flushed)
    writer.close()
    with pytest.warns(RecordingWarning, match="no index"), Recording(copy) as rec:
        n = len(rec.steps)  # the writer's unflushed tail (< chunk_steps) is lost
        assert rec.steps == list(range(n)) and 100 - 8 <= n < 100
        assert rec.state_at(n - 1).canonical() == truth[n - 1]
        assert rec.state_at(40).canonical() == truth[40]


def test_truncated_mid_frame(recorded, tmp_path):
    path, truth = recorded
    data = path.read_bytes()
    rng = random.Random(9)
    for cut in sorted(rng.sample(range(200, len(data) - 20), 6)):
        part = tmp_path / f"cut{cut}.kvtrace"
        part.write_bytes(data[:cut])
        with pytest.warns(RecordingWarning), Recording(part) as rec:
            if not rec.steps:
                continue
            assert rec.steps == list(range(len(rec.steps)))
            last = rec.steps[-1]
            assert rec.state_at(last).canonical() == truth[last]


def test_corrupt_frame_is_reported_with_the_file_name(recorded, tmp_path):
    path, _ = recorded
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside some frame's compressed payload
    bad = tmp_path / "flipped.kvtrace"
    bad.write_bytes(bytes(data))
    with Recording(bad) as rec:  # the index is intact ...
        with pytest.warns(RecordingWarning, match="flipped.kvtrace.*the replay ends after"):
            got = [b["step"] for b in rec]  # ... the replay stops at the damaged frame
        assert got == list(range(len(got))) and len(got) < len(rec.steps)
        assert rec.damage is not None and "\n" not in rec.damage
        assert f"ends after step {got[-1]}" in rec.damage if got else "before" in rec.damage
        assert rec.state_at(got[-1] if got else 0) is not None
        lost = got[-1] + 2  # inside the damaged frame, after the keyframe before it
        assert max(k for k in rec.keyframe_steps if k <= lost) < lost
        with pytest.raises(RecordingError, match="flipped.kvtrace"):
            rec.state_at(lost)  # needs the damaged frame: an error, never a wrong state


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (b"", "not a kvscope recording"),
        (b"hello world, this is not a trace", "not a kvscope recording"),
        (struct.pack(">8sII", b"KVSTRACE", 99, 0), "recording format 99"),
        (struct.pack(">8sII", b"KVSTRACE", 1, 50) + b"\x81", "header is truncated"),
        (struct.pack(">8sII", b"KVSTRACE", 1, 1) + b"\xc1", "header is not valid msgpack"),
        (struct.pack(">8sII", b"KVSTRACE", 1, 7) + b"\x81\xa8protocol\x05"[:7],
         "header"),
    ],
)
def test_foreign_files_are_rejected(tmp_path, content, words):
    p = tmp_path / "foreign.bin"
    p.write_bytes(content)
    with pytest.raises(RecordingError, match=words) as err:
        Recording(p)
    assert "foreign.bin" in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(RecordingError, match="cannot open recording"):
        Recording(tmp_path / "nope.kvtrace")


def test_keyframes_by_time(tmp_path):
    path = tmp_path / "t.kvtrace"
    gen = SyntheticCache(seed=2)
    truth = {}
    with EventStream(record_path=str(path), keyframe_every_steps=10**9,
                     keyframe_every_s=0.0, snapshot_fn=gen.canonical) as s:
        for step in range(5):
            s.end_step(step, gen.step(s.sink))
            truth[step] = gen.canonical()
            assert s.wait_idle(HANG_S)
            # the stream thread asks for one (time is due); the next end_step takes it
            wait_until(lambda: s._snap_wanted != s._snap_taken, "a snapshot request")
    with Recording(path) as rec:
        # each keyframe is the cache snapshot taken at the step after the request
        assert rec.keyframe_steps == [-1, 1, 2, 3, 4]
        for step in range(5):
            assert rec.state_at(step).canonical() == truth[step]


def test_decompression_bomb_is_refused(tmp_path, monkeypatch):
    """A frame that is small on disk but unpacks beyond the limit is an error."""
    import kvscope.engine.events.wire.recording as R

    st = KVState()
    st.apply({"v": 1, "step": 0, "events": [
        {"kind": "tier_init", "tier": "gpu", "num_blocks": 200_000, "block_size": 16}]})
    path = tmp_path / "bomb.kvtrace"
    with RecordingWriter(path) as w:
        w.keyframe(st, 1)
    monkeypatch.setattr(R, "MAX_FRAME_BYTES", 50_000)  # the keyframe unpacks to ~200 KB
    with Recording(path) as rec, pytest.raises(RecordingError, match="unpacks to more than"):
        rec.state_at(0)


def test_full_disk_ends_the_recording_alone_and_the_stream_goes_on(tmp_path, caplog):
    """Defect 7: a full disk under the recording killed the stream thread ("events are no
    longer published"), raised again at close, and the stream's stats kept claiming a
    good recording. The disk filling is real: mid-run, the writer's file object is
    swapped for one open on /dev/full, whose writes the kernel fails with ENOSPC."""
    path = tmp_path / "t.kvtrace"
    gen = SyntheticCache(seed=5)
    seen: list[dict] = []
    with caplog.at_level(logging.WARNING):
        s = EventStream(endpoint="tcp://127.0.0.1:0", record_path=str(path),
                        keyframe_every_steps=4, snapshot_fn=gen.canonical)
        published: list[int] = []
        real_publish = s.publisher.publish
        s.publisher.publish = lambda seq, payload: (published.append(seq),
                                                    real_publish(seq, payload))
        s.add_consumer(lambda batch: seen.append(batch))
        try:
            for step in range(6):
                s.end_step(step, gen.step(s.sink))
            assert s.wait_idle(HANG_S)
            rec = s.recorder
            rec.flush()
            rec._file.close()
            rec._file = open("/dev/full", "wb")  # noqa: SIM115 - the writer owns it
            for step in range(6, 20):
                s.end_step(step, gen.step(s.sink))
            assert s.wait_idle(HANG_S)
            assert s.stats.recording_error == os.strerror(errno.ENOSPC)
            assert s.recorder is None and rec.closed
            # every batch was still published and consumed, and the later ones say so
            assert published == list(range(1, 21)) and len(seen) == 20
            s.end_step(20, gen.step(s.sink))
            assert s.wait_idle(HANG_S)
            assert StepStats.read(seen[-1]["stats"]).recording_error == \
                os.strerror(errno.ENOSPC)
            assert StepStats.read(seen[0]["stats"]).recording_error is None
        finally:
            s.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "recording to" in errors[0].getMessage()
    assert "stream thread failed" not in caplog.text
    # the file keeps what was flushed before the disk filled: the first six steps
    with pytest.warns(RecordingWarning), Recording(path) as got:
        assert got.steps == list(range(6))
