"""A recording is untrusted input (issue: "safe to open"): the hostile files QA made, each
crafted here, open with bounded memory and end in a clear one-line error or a replay up
to the damage; never a traceback. The property-based version is test_fuzz_recordings.py."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import msgpack
import pytest

from kvscope.engine.bench.synthetic import SyntheticCache
from kvscope.engine.cli import main
from kvscope.engine.events import KVState
from kvscope.engine.events.wire import EventStream, Recording, RecordingError, RecordingWarning
from kvscope.engine.events.wire.recording import (
    DELTAS,
    KEYFRAME,
    MAX_FRAME_BYTES,
    frame_limit,
)
from tests.events.kvtrace_craft import Frame, build, parse, zstd_bomb

STEPS = 120
BOUND = 200 << 20  # what reading any file may allocate (Python heap), with room


@pytest.fixture(scope="module")
def intact(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("rec") / "run.kvtrace"
    gen = SyntheticCache(seed=4)
    with EventStream(record_path=str(path), header={"model": "synthetic"},
                     keyframe_every_steps=40, snapshot_fn=gen.canonical) as s:
        for step in range(STEPS):
            s.end_step(step, gen.step(s.sink))
    return path.read_bytes()


@pytest.fixture(scope="module")
def gib_bomb() -> bytes:
    return zstd_bomb(1 << 30)  # ~33 KB that unpacks to 1 GiB (QA's file)


def _write(tmp_path: Path, data: bytes, name: str = "bad.kvtrace") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


def _read_all(path: Path) -> tuple[list[int], Recording]:
    """Every readable step (iteration) and the Recording, warnings collected."""
    with _quiet(), Recording(path) as rec:
        steps = [b["step"] for b in rec]
    return steps, rec


class _quiet:
    def __enter__(self) -> None:
        import warnings
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore", RecordingWarning)

    def __exit__(self, *exc: object) -> None:
        self._w.__exit__(*exc)


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _damaged_delta(intact: bytes, k: int, body: bytes) -> bytes:
    header, frames = parse(intact)
    deltas = [i for i, f in enumerate(frames) if f.kind == DELTAS]
    frames[deltas[k]] = Frame(DELTAS, frames[deltas[k]].meta, b"").with_body(body)
    return build(header, frames)


def test_a_gib_bomb_delta_frame_ends_the_replay_with_bounded_memory(intact, gib_bomb,
                                                                    tmp_path, capsys):
    header, frames = parse(intact)
    deltas = [i for i, f in enumerate(frames) if f.kind == DELTAS]
    frames[deltas[1]] = Frame(DELTAS, frames[deltas[1]].meta, gib_bomb)  # checksum valid
    path = _write(tmp_path, build(header, frames))
    assert path.stat().st_size < 64 << 10
    got: list[int] = []
    peak = _peak(lambda: got.extend(_read_all(path)[0]))
    assert peak < BOUND, peak
    first = frames[deltas[1]].meta["first"]
    assert got == list(range(first))  # every step before the bomb
    with Recording(path) as rec, pytest.warns(RecordingWarning, match="unpacks to more than"):
        list(rec)
    assert rec.damage and "\n" not in rec.damage and f"ends after step {first - 1}" in rec.damage
    # the CLI: what it could read is written, one line says why the rest is not, exit 1
    assert main(["export", str(path), "-o", str(tmp_path / "t.json")]) == 1
    err = capsys.readouterr().err
    assert "unpacks to more than" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_a_bomb_keyframe_is_a_clear_error(intact, gib_bomb, tmp_path):
    header, frames = parse(intact)
    keys = [i for i, f in enumerate(frames) if f.kind == KEYFRAME]
    frames[keys[1]] = Frame(KEYFRAME, frames[keys[1]].meta, gib_bomb)
    path = _write(tmp_path, build(header, frames))
    step = frames[keys[1]].meta["step"]

    def seek() -> None:
        with Recording(path) as rec, pytest.raises(RecordingError, match="unpacks to more"):
            rec.state_at(step)

    assert _peak(seek) < BOUND


def test_the_frame_limit_follows_the_header_geometry():
    assert frame_limit({}, DELTAS, 64) == MAX_FRAME_BYTES  # no geometry: the cap
    small = {"engine": {"num_gpu_blocks": 1000, "block_size": 16}}
    assert frame_limit(small, KEYFRAME) == (1 << 20) + 1000 * 64
    assert frame_limit(small, DELTAS, 64) == (1 << 20) + 1000 * 64 * 64
    absurd = {"config": {"num_gpu_blocks": 10**15}}
    assert frame_limit(absurd, DELTAS, 64) == MAX_FRAME_BYTES  # never over the cap


def test_a_frame_over_its_geometry_limit_is_refused(intact, tmp_path):
    header, frames = parse(intact)
    header["engine"] = {"num_gpu_blocks": 1}  # a 1-block cache: deltas fit in ~1 MiB
    deltas = [i for i, f in enumerate(frames) if f.kind == DELTAS]
    frames[deltas[0]] = Frame(DELTAS, frames[deltas[0]].meta, zstd_bomb(8 << 20))
    steps, rec = _read_all(_write(tmp_path, build(header, frames)))
    limit = frame_limit(header, DELTAS, frames[deltas[0]].meta["n"])
    assert limit < 2 << 20
    assert steps == [] and f"unpacks to more than {limit} bytes" in rec.damage


@pytest.mark.parametrize("batch", [
    {"v": 2, "type": "batch", "epoch": "e", "seq": 1, "step": "x", "time": 0.0, "events": []},
    {"v": 2, "step": "x", "events": []},
    {"v": 2, "step": 5, "events": [{"kind": "alloc", "tier": "gpu", "blocks": "many"}]},
    {"v": 2, "step": 5, "events": [{"kind": 7}]},
    {"v": 2, "step": 5, "events": {"kind": "alloc"}},
    [1, 2, 3],
])
def test_a_valid_checksum_frame_with_wrong_types_ends_the_replay(intact, tmp_path, capsys,
                                                                 batch):
    path = _write(tmp_path, _damaged_delta(intact, 1, msgpack.packb(batch)))
    steps, rec = _read_all(path)
    assert steps and steps == list(range(len(steps))) and len(steps) < STEPS
    assert rec.damage and "delta frame at byte" in rec.damage
    assert main(["export", str(path), "-o", str(tmp_path / "t.json")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_an_absurd_tier_is_refused_by_the_mirror_not_allocated(intact, tmp_path):
    batch = {"v": 2, "step": 0, "events": [
        {"kind": "tier_init", "tier": "gpu", "num_blocks": (1 << 31) - 1, "block_size": 16}]}
    header, frames = parse(intact)
    first = [f for f in frames if f.kind == DELTAS][0]
    frames = [frames[0], Frame(DELTAS, {"first": 0, "last": 0, "n": 1, "seq": [1, 1]},
                               b"").with_body(msgpack.packb(batch))]
    assert first.meta["first"] == 0
    path = _write(tmp_path, build(header, frames))

    def seek() -> None:
        with Recording(path) as rec, pytest.raises(RecordingError, match="bad size"):
            rec.state_at(0)

    assert _peak(seek) < BOUND
    with pytest.raises(Exception, match="bad size"):
        KVState().apply(batch)


@pytest.mark.parametrize("meta", [
    {"first": 0, "last": 10**12, "n": 64, "seq": [0, 0]},  # a range its count cannot hold
    {"first": 0, "last": 10**12, "n": 10**12 + 1, "seq": [0, 0]},  # a count no frame holds
    {"first": "a", "last": 3, "n": 4},
    {"first": 0, "last": 3, "n": 4, "steps": [0, 1, 2, "x"]},
    {"first": 0, "last": 3, "n": 4, "steps": [0, 3, 2, 3]},
])
def test_absurd_frame_metadata_is_not_trusted(intact, tmp_path, meta):
    header, frames = parse(intact)
    deltas = [i for i, f in enumerate(frames) if f.kind == DELTAS]
    frames[deltas[0]] = Frame(DELTAS, meta, frames[deltas[0]].z)
    for index in (True, False):  # a bad index entry falls back to the scan, which stops
        path = _write(tmp_path, build(header, frames, index=index), f"m{index}.kvtrace")
        with pytest.warns(RecordingWarning, match="truncated or corrupt"), \
                Recording(path) as rec:
            assert len(rec.steps) < 10**6 and rec.steps == []


def test_export_of_a_file_without_steps_fails_like_inspect(intact, tmp_path, capsys):
    from kvscope.inspector.app import open_recording
    from kvscope.inspector.errors import InspectError

    header, frames = parse(intact)
    path = _write(tmp_path, build(header, frames[:1]), "nosteps.kvtrace")  # a keyframe only
    assert main(["export", str(path), "-o", str(tmp_path / "t.json")]) == 2
    err = capsys.readouterr().err.strip()
    with pytest.raises(InspectError) as e:
        open_recording(path)
    assert err == f"kvscope export: {e.value}"
    assert "holds no engine steps" in err
    assert not (tmp_path / "t.json").exists()
