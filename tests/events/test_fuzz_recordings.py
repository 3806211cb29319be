"""Fuzzing (hypothesis): real recordings and live frames, mutated (truncated, bytes
flipped, frames rewritten with a valid checksum and wrong types, decompression bombs,
absurd header geometry). Whatever the bytes, reading ends in a RecordingError/ProtocolError
or a replay up to the damage: no other exception (a traceback), memory bounded.

Cost, bounded: EXAMPLES examples per property, derandomized (the same examples every run),
no deadline; ~15 s in all on the 2-core dev box. KVSCOPE_FUZZ_EXAMPLES=2000 digs deeper
(random examples) by hand."""

from __future__ import annotations

import os
import tracemalloc
import warnings
import zlib
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.engine.bench.synthetic import SyntheticCache
from kvscope.engine.events import KVState, ProtocolError
from kvscope.engine.events.analysis.lifecycle import LifecycleIndex
from kvscope.engine.events.sink import ListSink
from kvscope.engine.events.wire import EventStream, Recording, RecordingError, RecordingWarning
from kvscope.engine.events.wire import codec as C
from kvscope.engine.events.wire.recording import DELTAS, KEYFRAME
from tests.events.kvtrace_craft import Frame, build, parse, zstd_bomb

DEEP = os.environ.get("KVSCOPE_FUZZ_EXAMPLES")
EXAMPLES = int(DEEP or 60)
BOUND = 200 << 20
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not DEEP,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])

_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=4),
    max_leaves=12)


@pytest.fixture(scope="module")
def intact(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("rec") / "run.kvtrace"
    gen = SyntheticCache(seed=8)
    with EventStream(record_path=str(path), header={"model": "fuzz"}, keyframe_every_steps=25,
                     snapshot_fn=gen.canonical) as s:
        for step in range(80):
            s.end_step(step, gen.step(s.sink))
    return path.read_bytes()


@pytest.fixture(scope="module")
def bomb() -> bytes:
    return zstd_bomb(256 << 20)


def _mutate_value(obj: Any, path: list[int], value: Any) -> Any:
    """``obj`` with the value at a path (indices into map items / list items) replaced."""
    if not path or not isinstance(obj, (dict, list)) or not obj:
        return value
    i = path[0] % len(obj)
    if isinstance(obj, dict):
        k = list(obj)[i]
        return {**obj, k: _mutate_value(obj[k], path[1:], value)}
    return [*obj[:i], _mutate_value(obj[i], path[1:], value), *obj[i + 1:]]


@st.composite
def hostile_files(draw: st.DrawFn, intact: bytes, bomb: bytes) -> bytes:
    header, frames = parse(intact)
    how = draw(st.sampled_from(["truncate", "flip", "retype", "bomb", "geometry", "meta"]))
    if how == "truncate":
        return intact[:draw(st.integers(0, len(intact)))]
    if how == "flip":
        data = bytearray(intact)
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
        return bytes(data)
    j = draw(st.integers(0, len(frames) - 1))
    f = frames[j]
    if how == "retype":  # a frame whose checksum is valid and whose content is wrong
        unpacker = msgpack.Unpacker(raw=False)
        unpacker.feed(f.body)
        msgs = list(unpacker)
        k = draw(st.integers(0, len(msgs) - 1))
        path = draw(st.lists(st.integers(0, 50), max_size=6))
        msgs[k] = _mutate_value(msgs[k], path, draw(_values))
        frames[j] = f.with_body(b"".join(msgpack.packb(m) for m in msgs))
    elif how == "bomb":
        frames[j] = Frame(f.kind, f.meta, bomb)
    elif how == "geometry":
        header = {**header, draw(st.sampled_from(["engine", "config", "geometry"])): {
            "num_gpu_blocks": draw(st.integers(-(1 << 40), 1 << 62))}}
    else:  # meta
        path = draw(st.lists(st.integers(0, 10), max_size=3))
        frames[j] = Frame(f.kind, _mutate_value(f.meta, path, draw(_values)), f.z)
    return build(header, frames, index=draw(st.booleans()))


def _read_everything(path: Any) -> None:
    """All a reader does with a file: open, iterate, seek every keyframe and the last step,
    index the lifecycle; only RecordingError may escape (a file it cannot open)."""
    try:
        rec = Recording(path)
    except RecordingError:
        return
    with rec:
        steps = [b["step"] for b in rec.batches()]
        assert steps == sorted(set(steps))
        assert rec.damage is None or "\n" not in rec.damage
        for s in [*rec.keyframe_steps, *steps[-1:]]:
            try:
                rec.state_at(s)
            except RecordingError as e:
                assert "\n" not in str(e)
        LifecycleIndex.from_batches(rec.batches())


def test_fuzzed_recordings_never_raise_past_the_reader(intact, bomb, tmp_path):
    @FUZZ
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        path = tmp_path / "fuzz.kvtrace"
        path.write_bytes(data.draw(hostile_files(intact, bomb)))
        tracemalloc.start()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RecordingWarning)
                _read_everything(path)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < BOUND, peak

    run()


@pytest.fixture(scope="module")
def live_frames() -> list[list[bytes]]:
    gen, sink, codec, out = SyntheticCache(seed=9), ListSink(), C.Codec(), []
    for step in range(30):
        stats = gen.step(sink)
        out.append(codec.encode_frames(C.make_batch("e", step + 1, step, 0.0,
                                                    C.pack_events(sink.drain()), stats)))
    return out


def test_fuzzed_live_frames_are_refused_or_applied_cleanly(live_frames):
    """What a hostile publisher can send a subscriber: the codec refuses it
    (ProtocolError) or the mirror does (atomically); never another exception."""

    @FUZZ
    @given(k=st.integers(0, 29), how=st.sampled_from(["flip", "truncate", "retype", "size"]),
           data=st.data())
    def run(k: int, how: str, data: st.DataObject) -> None:
        codec, mirror = C.Codec(max_bytes=1 << 20), KVState()
        for frames in live_frames[:k]:
            mirror.apply(codec.decode_frames(frames)[1])
        topic, seq, payload = live_frames[k]
        if how == "flip":
            b = bytearray(payload)
            b[data.draw(st.integers(0, len(b) - 1))] ^= data.draw(st.integers(1, 255))
            payload = bytes(b)
        elif how == "truncate":
            payload = payload[:data.draw(st.integers(0, len(payload)))]
        elif how == "retype":
            msg = msgpack.unpackb(payload, raw=False)
            path = data.draw(st.lists(st.integers(0, 50), max_size=6))
            payload = msgpack.packb(_mutate_value(msg, path, data.draw(_values)))
        else:  # a declared length far past the bytes sent (a "4 GiB array" header)
            payload = payload[:8] + b"\xdd\xff\xff\xff\xff" + payload[8:]
        before = mirror.canonical()
        try:
            _, msg = codec.decode_frames([topic, seq, payload])
            mirror.apply(msg)
        except ProtocolError:
            assert mirror.canonical() == before  # a refused batch changes nothing

    run()


def test_checksums_are_what_the_fuzzer_keeps_valid(intact):
    """The crafting helper writes valid checksums (else every rewrite would only test the
    CRC check): a rebuilt intact file reads back whole."""
    header, frames = parse(intact)
    data = build(header, frames)
    assert zlib.crc32(data) != 0
    assert {f.kind for f in frames} == {KEYFRAME, DELTAS}
