"""Protocol 3: a bulk step travels as one frame of packed columns (``cols``), any other
step as events; decoded, both read as the whole step again and apply exactly like the
per-event reference; live subscribers and recordings of column frames converge; a bad
``cols`` is refused with a clear error and loses nothing."""

from __future__ import annotations

import threading

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.engine.bench.event_workloads import bulk_batches
from kvscope.engine.events import PROTOCOL_VERSION, KVState, ProtocolError
from kvscope.engine.events.state import unpack_ids
from kvscope.engine.events.wire import EventStream, Subscriber
from kvscope.engine.events.wire import codec as C
from kvscope.engine.events.wire.recording import Recording
from tests.events.conftest import poll_until, synced_to
from tests.events.test_columns import SETUP, all_arrays, full_state, schema_event

EP = "tcp://127.0.0.1:0"


def bulk(steps: int = 6) -> list[dict]:
    """A valid stream of 128-block prefill bursts on a 4096-block tier, as batches."""
    return [C.make_batch("e", i + 1, i, float(i), ev, st) for i, (ev, st) in
            enumerate(bulk_batches(steps, blocks_per_seq=128, live=4, num_blocks=4096))]


def plain(events: list[dict]) -> list[dict]:
    """Events with id lists as lists and a hit's absent tokens as 0 (the decoded form)."""
    out = []
    for ev in events:
        ev = {k: (unpack_ids(v) if k == "blocks" else v) for k, v in ev.items()}
        if ev["kind"] == "hit":
            ev.setdefault("tokens", 0)
        out.append(ev)
    return out


def test_bulk_steps_travel_as_columns_and_decode_to_the_same_step():
    assert PROTOCOL_VERSION == 3
    codec = C.Codec()
    batches = bulk()
    ref, fast = KVState(), KVState()
    kinds = []
    for b in batches:
        data = codec.encode(b)
        raw = msgpack.unpackb(data)
        kinds.append("cols" in raw)
        msg = codec.decode(data)
        assert plain(msg["events"]) == plain(b["events"])  # the whole step, in order
        assert ("columns" in msg) == ("cols" in raw)
        if "cols" in raw:  # only the other events travel as maps
            assert all(e["kind"] not in ("alloc", "store", "free", "evict")
                       for e in raw["events"])
        ref.apply(b)
        fast.apply(msg)
        assert fast.canonical() == ref.canonical()
    assert kinds[0] is False and all(kinds[1:])  # tier_init alone; then bulk steps
    assert fast.columns_refused == 0 and codec.num_errors == 0


def test_small_steps_stay_events():
    codec = C.Codec()
    b = C.make_batch("e", 1, 0, 0.0, [
        {"kind": "tier_init", "tier": "gpu", "num_blocks": 8, "block_size": 4},
        {"kind": "seq_add", "seq": "a"},
        {"kind": "alloc", "tier": "gpu", "seq": "a", "blocks": [1, 2]}])
    raw = msgpack.unpackb(codec.encode(b))
    assert "cols" not in raw and len(raw["events"]) == 3


def test_a_decoded_column_batch_encodes_again_as_columns():
    """What ``kvscope record`` does with a subscriber's batches: decode, then write."""
    codec = C.Codec()
    msg = codec.decode(codec.encode(bulk(3)[2]))
    again = codec.decode(codec.encode(msg))
    assert "columns" in again and plain(again["events"]) == plain(msg["events"])
    # the per-event form of the same batch (the benchmarks' baseline) decodes the same
    events_only = codec.decode(codec.encode(msg, columns=False))
    assert "columns" not in events_only
    assert plain(events_only["events"]) == plain(msg["events"])


def test_bad_columns_are_refused_with_a_clear_error():
    codec = C.Codec()
    good = msgpack.unpackb(codec.encode(bulk(3)[2]))
    for bad, words in [
        ({**good, "cols": {**good["cols"], "kind": good["cols"]["kind"][:-1]}},
         "'off' are not offsets|entries for"),
        ({**good, "cols": {**good["cols"], "ids": b"\x01\x02\x03"}}, "whole number"),
        ({**good, "cols": {**good["cols"],
                           "tier": np.full(len(good["cols"]["tier"]), 9, "u1").tobytes()}},
         "tier code"),
        ({**good, "cols": "columns"}, "not a map|cols"),
        ({**good, "v": 2}, "protocol 2"),
    ]:
        with pytest.raises(ProtocolError, match=words):
            codec.decode(msgpack.packb(bad))
    assert codec.errors["columns"] + codec.errors["envelope"] == 5


def test_live_subscriber_and_recording_converge_on_column_frames(tmp_path):
    batches = bulk(8)
    truth = KVState()
    path = tmp_path / "bulk.kvtrace"
    with EventStream(EP, str(path), engine_lock=threading.Lock(),
                     snapshot_fn=lambda: truth.snapshot()) as stream, \
            Subscriber(stream.endpoint, stream.snapshot_endpoint) as sub:
        poll_until([sub], synced_to([sub], 0))
        for b in batches:
            with stream.engine_lock:
                truth.apply(b)
                for ev in b["events"]:
                    stream.sink.emit(**ev)
                stream.end_step(b["step"], b["stats"])
            poll_until([sub], synced_to([sub], stream.seq))
            assert sub.state.canonical() == truth.canonical()
        assert sub.state.columns_refused == 0
    with Recording(path) as rec:
        assert rec.header["protocol"] == 3
        st = KVState()
        for batch in rec:
            st.apply(batch)
        assert st.canonical() == truth.canonical()
        assert rec.state_at(batches[-1]["step"]).canonical() == truth.canonical()


# ------------------------------------------------- every kind, through the codec
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(schema_event(), max_size=12), min_size=1, max_size=10))
def test_random_streams_through_column_frames_apply_like_event_frames(monkeypatch, steps):
    """Every step written as columns (thresholds at 0), decoded (ids packed, events
    rebuilt) and applied with arrays == the same step as per-event frames applied by the
    reference: the same error or none, the same state after every step."""
    all_arrays(monkeypatch)
    codec = C.Codec()
    ref, fast = KVState(), KVState()
    for i, events in enumerate([list(SETUP), *steps]):
        batch = C.make_batch("e", i + 1, i, float(i), events)
        try:
            frames = [codec.encode(batch, columns=False)]
        except OverflowError:  # an int msgpack cannot hold: no writer can send this step
            return
        frames.append(codec.encode(batch))  # as columns: must encode whenever events do
        outcome = []
        for state, data in zip((ref, fast), frames, strict=True):
            try:
                msg = codec.decode(data)
                assert ("columns" in msg) == (state is fast)
                state.apply(msg)
                outcome.append(None)
            except ProtocolError as e:
                outcome.append(str(e))
        assert outcome[0] == outcome[1]
        assert full_state(fast) == full_state(ref)
