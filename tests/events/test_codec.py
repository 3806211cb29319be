"""The codec rejects everything malformed with a clear, counted ProtocolError."""

from __future__ import annotations

import msgpack
import pytest

from kvscope.engine.events import schema as S
from kvscope.engine.events.schema import PROTOCOL_VERSION, ProtocolError
from kvscope.engine.events.wire import codec as C


def good_batch(seq: int = 1) -> dict:
    return C.make_batch("e1", seq, 7, 1.5, [{"kind": "seq_add", "seq": "a"}], {"running": 1})


def test_batch_round_trip_through_frames():
    codec = C.Codec()
    frames = codec.encode_frames(good_batch(42))
    assert frames[0] == C.TOPIC and frames[1] == (42).to_bytes(8, "big")
    seq, msg = codec.decode_frames(frames)
    assert seq == 42 and msg == good_batch(42)
    assert codec.num_errors == 0


def test_unknown_fields_are_kept_and_ignored():
    codec = C.Codec()
    msg = {**good_batch(), "future_field": [1, 2]}
    assert codec.decode(codec.encode(msg))["future_field"] == [1, 2]


@pytest.mark.parametrize(
    ("data", "reason", "words"),
    [
        (b"\xc1garbage", "msgpack", "undecodable msgpack"),
        (b"\x01\x02\x03", "msgpack", "undecodable msgpack"),  # trailing bytes
        (msgpack.packb(good_batch())[:-3], "msgpack", "undecodable msgpack"),  # truncated
        (b"\x81\xa1v\xc6\xff\xff\xff\xf0abc", "msgpack", "incomplete"),  # 4 GiB bin
        (b"\xdd\xff\xff\xff\xff", "msgpack", "exceeds"),  # 4G-element array declared
        (msgpack.packb({1: 2}), "msgpack", "undecodable"),  # int map key (strict_map_key)
        (msgpack.packb([1, 2]), "envelope", "expected a map"),
        (msgpack.packb({**good_batch(), "v": 99}), "envelope", "protocol version 99"),
        (msgpack.packb({**good_batch(), "v": True}), "envelope", "protocol version"),
        (msgpack.packb({**good_batch(), "type": "nope"}), "envelope", "unknown message type"),
        (msgpack.packb({**good_batch(), "seq": "1"}), "envelope", "field 'seq' is str"),
        (msgpack.packb({**good_batch(), "seq": True}), "envelope", "field 'seq' is bool"),
        (msgpack.packb({**good_batch(), "seq": -5}), "envelope", "negative"),
        (msgpack.packb({**good_batch(), "events": [1]}), "envelope", "string 'kind'"),
        (msgpack.packb({**good_batch(), "stats": [1]}), "envelope", "'stats' is not a map"),
    ],
)
def test_malformed_messages_are_rejected_and_counted(data, reason, words):
    codec = C.Codec()
    with pytest.raises(ProtocolError, match=words):
        codec.decode(data)
    assert codec.errors[reason] == 1
    # the codec keeps working after a failure (no reused, poisoned Unpacker)
    assert codec.decode(codec.encode(good_batch()))["seq"] == 1


def test_size_limit():
    codec = C.Codec(max_bytes=100)
    with pytest.raises(ProtocolError, match="exceeds limit 100"):
        codec.decode(msgpack.packb({**good_batch(), "pad": "x" * 200}))
    assert codec.errors["size"] == 1


@pytest.mark.parametrize(
    ("frames", "words"),
    [
        ([C.TOPIC, (1).to_bytes(8, "big")], "expected 3 frames"),
        ([b"other", (1).to_bytes(8, "big"), b""], "unexpected topic"),
        ([C.TOPIC, b"\x00\x01", msgpack.packb(good_batch())], "seq frame has 2 bytes"),
        ([C.TOPIC, (2).to_bytes(8, "big"), msgpack.packb(good_batch(1))], "disagrees"),
        ([C.TOPIC, (1).to_bytes(8, "big"),
          msgpack.packb(C.make_request(C.MSG_ERROR, reason="x"))], "on the PUB stream"),
    ],
)
def test_bad_frames(frames, words):
    codec = C.Codec()
    with pytest.raises(ProtocolError, match=words):
        codec.decode_frames(frames)
    assert codec.num_errors == 1


def test_request_and_reply_envelopes():
    codec = C.Codec()
    for msg in [
        C.make_request(C.MSG_GET_SNAPSHOT, id=1),
        C.make_request(C.MSG_REPLAY, **{"from": 5}, id=2),
        C.make_request(C.MSG_REPLAY_END, epoch="e", ok=False, reason="gone"),
        C.make_snapshot("e", 3, {"v": PROTOCOL_VERSION, "step": 2, "tiers": {}, "seqs": []}),
        C.make_heartbeat("e", 3, 0.0),
    ]:
        assert codec.decode(codec.encode(msg)) == msg
    with pytest.raises(ProtocolError, match="'ok' is int"):
        codec.decode(codec.encode(C.make_request(C.MSG_REPLAY_END, epoch="e", ok=1)))


def _engine_batches() -> list[dict]:
    """What the real cache manager emits (a small pool: evictions with their causes,
    store details) and the synthetic workload (swaps, offloads, host hits), as batches
    of protocol 2 (ids packed) and protocol 1 (lists)."""
    from kvscope.engine.bench.event_workloads import ManagerWorkload
    from kvscope.engine.bench.synthetic import SyntheticCache
    from kvscope.engine.cache import KVCacheManager
    from kvscope.engine.events.sink import ListSink

    sink, gen = ListSink(), SyntheticCache(seed=4)
    sink.store_detail = True
    work = ManagerWorkload(KVCacheManager(48, 4, num_cpu_blocks=16, sink=sink), seed=1,
                           max_running=12, vocab=50)
    steps = []
    for _ in range(150):
        stats = work.step()
        steps.append((sink.drain(), stats))
        stats = gen.step(sink)
        steps.append((sink.drain(), stats))
    from tests.disk.fake_disk import scenario_steps

    steps += [(events, {}) for events in scenario_steps(sink)]  # the disk tier's kinds
    # a hybrid cache's window group: group fields and release events
    hybrid = KVCacheManager(16, 4, enable_prefix_caching=False, window=8,
                            num_window_blocks=8, sink=sink)
    hybrid.add_sequence("w", list(range(9)))
    hybrid.allocate_slots("w", 9)
    hybrid.start("w")
    hybrid.fork("w", "w2")
    for t in range(9):
        hybrid.allocate_slots("w", 1)
        hybrid.append_token_ids("w", [t])
    hybrid.finish("w", "stop")
    hybrid.flush_step_events()
    steps.append((sink.drain(), {}))
    out = []
    for i, (events, stats) in enumerate(steps):
        out.append(C.make_batch("e", i + 1, i, 0.5, C.pack_events([dict(e) for e in events]),
                                stats))
        out.append({**C.make_batch("e", i + 1, i, 0.5, [dict(e) for e in events], stats),
                    "v": 1})
    return out


def test_typed_and_checked_decoding_give_the_same_maps():
    """Codec.decode reads batches of known kinds straight into their types; the checked
    path (plain maps, then each event converted) is the reference: same maps, and the
    events as they were sent."""
    codec = C.Codec()
    batches = _engine_batches()
    assert {e["kind"] for b in batches for e in b["events"]} >= set(S.EVENT_KINDS) - {
        S.QUANTIZE}
    assert any("cause" in e for b in batches for e in b["events"])
    for b in batches:
        data = codec.encode(b)
        assert codec.decode(data) == codec.decode_checked(data) == msgpack.unpackb(data)
    assert codec.num_errors == 0


def test_each_event_is_checked_against_its_kind():
    codec = C.Codec()
    ok = {"kind": "alloc", "tier": "gpu", "seq": "a", "blocks": [1, 2]}
    for bad, words in [
        ({**ok, "seq": 7}, r"event 1 \(alloc\): Expected `str`, got `int` - at `\$.seq`"),
        ({**ok, "blocks": "1,2"}, r"\(alloc\).*`\$.blocks`"),
        ({**ok, "blocks": [1, True]}, r"\(alloc\).*got `bool` - at `\$.blocks\[1\]`"),
        ({"kind": "alloc", "tier": "gpu", "blocks": [1]}, r"\(alloc\).*missing.*`seq`"),
        ({"kind": "seq_finish", "seq": "a", "reason": "stop", "num_tokens": None},
         r"\(seq_finish\).*`\$.num_tokens`"),
        ({"kind": "evict", "tier": "gpu", "blocks": [1], "cause": {"blocks_needed": "3"}},
         r"\(evict\).*`\$.cause.blocks_needed`"),
    ]:
        msg = C.make_batch("e", 1, 1, 0.0, [{"kind": "seq_add", "seq": "a"}, bad])
        with pytest.raises(ProtocolError, match=words):
            codec.decode(codec.encode(msg))
    assert codec.errors["envelope"] == 6 and codec.num_errors == 6


def test_unknown_kinds_pass_and_undeclared_event_fields_are_dropped():
    """Forward compatibility: a newer writer's kinds reach the readers as sent (they
    count and skip them); fields a kind does not declare are left out, the declared ones
    kept as sent (an optional field given at a reader's default too)."""
    codec = C.Codec()
    events = [{"kind": "teleport", "blocks": [1], "to": "moon"},
              {"kind": "seq_add", "seq": "a", "priority": 0, "colour": "red"}]
    got = codec.decode(codec.encode(C.make_batch("e", 1, 1, 0.0, events)))
    assert got["events"] == [events[0], {"kind": "seq_add", "seq": "a", "priority": 0}]
    assert codec.num_errors == 0
