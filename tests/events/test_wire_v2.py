"""Protocol 2: packed id lists on the wire, version-1 files still replay identically, the
``quantize`` kind, and the stream's batch consumers."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import msgpack
import pytest

from kvscope.engine.bench.synthetic import SyntheticCache
from kvscope.engine.events import PROTOCOL_VERSION, KVState, ListSink, ProtocolError
from kvscope.engine.events.state import pack_ids, unpack_ids
from kvscope.engine.events.wire import EventStream
from kvscope.engine.events.wire import codec as C
from kvscope.engine.events.wire.recording import Recording
from tests.waiting import HANG_S

FIXTURES = Path(__file__).parent / "fixtures"
SAMPLE = Path(__file__).parents[2] / "assets" / "sample.kvtrace"


def synthetic_batches(seed: int, steps: int) -> list[dict]:
    gen, sink, out = SyntheticCache(seed=seed), ListSink(), []
    for step in range(steps):
        stats = gen.step(sink)
        out.append(C.make_batch("e", step + 1, step, float(step), sink.drain(), stats))
    return out


def test_packed_ids_round_trip_and_are_smaller():
    ids = [0, 1, 2**31 - 1, 70_000]
    assert pack_ids(ids) == b"".join(i.to_bytes(4, "little") for i in ids)
    assert unpack_ids(pack_ids(ids)) == ids
    # ids of a 1M-block tier take 5 bytes as msgpack ints, 4 packed (the main gain is
    # decoding one bytes object instead of one int object per id)
    batch = C.make_batch("e", 1, 0, 0.0, [{"kind": "alloc", "tier": "gpu", "seq": "a",
                                           "blocks": list(range(500_000, 500_064))}])
    v1 = len(C.Codec().encode(batch))
    C.pack_events(batch["events"])
    assert isinstance(batch["events"][0]["blocks"], bytes)
    assert len(C.Codec().encode(batch)) < v1 * 0.9


def test_packed_and_list_batches_build_the_same_state():
    """The same events through the wire (packed, v2) and as lists (v1) agree exactly."""
    codec, packed, lists = C.Codec(), KVState(), KVState()
    for batch in synthetic_batches(3, 200):
        v1 = {**batch, "v": 1}
        lists.apply(v1)
        wire = msgpack.unpackb(msgpack.packb(batch), raw=False)  # deep copy of lists
        C.pack_events(wire["events"])
        decoded = codec.decode(codec.encode(wire))
        assert decoded["v"] == PROTOCOL_VERSION
        packed.apply(decoded)
        assert packed.canonical() == lists.canonical()
    assert [t.owner.tolist() for t in packed.tiers.values()] == [
        t.owner.tolist() for t in lists.tiers.values()]


@pytest.mark.parametrize("blocks", [b"\x00\x00\x00", [True], [1.0], "01", [None]])
def test_malformed_id_lists_are_rejected(blocks):
    st = KVState()
    st.apply({"v": 2, "step": 0, "events": [
        {"kind": "tier_init", "tier": "gpu", "num_blocks": 8, "block_size": 4},
        {"kind": "seq_add", "seq": "a"}]})
    before = st.canonical()
    with pytest.raises(ProtocolError):
        st.apply({"v": 2, "step": 1, "events": [
            {"kind": "alloc", "tier": "gpu", "seq": "a", "blocks": [0]},
            {"kind": "alloc", "tier": "gpu", "seq": "a", "blocks": blocks}]})
    assert st.canonical() == before


def _digest(canon: dict) -> str:
    for t in canon["tiers"].values():  # written before per-block formats existed
        assert t.pop("block_formats") == {}
    return hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()[:16]


def test_version_1_recording_replays_identically():
    """A file written by release 720ace1 (protocol 1), with the digest of the true
    cache state after every step as that release computed it."""
    digests = json.loads((FIXTURES / "v1_synthetic.json").read_text())["digests"]
    with Recording(FIXTURES / "v1_synthetic.kvtrace") as rec:
        assert rec.header["protocol"] == 1
        assert rec.steps == [int(s) for s in digests]
        st = KVState()
        for batch in rec:
            assert batch["v"] == 1 and isinstance(batch["events"], list)
            st.apply(batch)
            assert _digest(dict(st.canonical())) == digests[str(batch["step"])]
        for step in (0, 39, 40, 77, 119):  # seeks: v1 keyframes + v1 deltas
            assert _digest(dict(rec.state_at(step).canonical())) == digests[str(step)]


def test_sample_recording_still_opens_and_replays():
    with Recording(SAMPLE) as rec:
        st = KVState()
        for batch in rec:
            st.apply(batch)
        last = rec.steps[-1]
        assert rec.state_at(last).canonical() == st.canonical()
        assert st.seqs or any(t.ref.any() for t in st.tiers.values()) or rec.steps


def test_quantize_changes_only_the_per_block_format():
    st = KVState()
    st.apply({"v": 2, "step": 0, "events": [
        {"kind": "tier_init", "tier": "gpu", "num_blocks": 8, "block_size": 4,
         "format": "fp16"},
        {"kind": "seq_add", "seq": "a"},
        {"kind": "alloc", "tier": "gpu", "seq": "a", "blocks": pack_ids([2, 3])},
        {"kind": "store", "tier": "gpu", "blocks": [2], "hashes": [77]}]})
    refs = st.tiers["gpu"].ref.tolist()
    st.apply({"v": 2, "step": 1, "events": [
        {"kind": "quantize", "tier": "gpu", "blocks": pack_ids([2, 3]), "format": "int8"},
        {"kind": "quantize", "tier": "gpu", "blocks": [3], "format": "fp16"}]})
    canon = st.canonical()
    assert canon["tiers"]["gpu"]["block_formats"] == {2: "int8"}  # 3 is back to fp16
    assert canon["tiers"]["gpu"]["ref"] == refs and canon["tiers"]["gpu"]["hash"][2] == 77
    assert canon["seqs"]["a"]["block_table"] == [2, 3]
    assert KVState.from_snapshot(st.snapshot()).canonical() == canon
    assert KVState.from_canonical(canon).canonical() == canon
    with pytest.raises(ProtocolError):  # atomic: the valid quantize does not stick
        st.apply({"v": 2, "step": 2, "events": [
            {"kind": "quantize", "tier": "gpu", "blocks": [3], "format": "int4"},
            {"kind": "quantize", "tier": "gpu", "blocks": [99], "format": "int4"}]})
    assert st.canonical() == canon and st.tiers["gpu"].format_names == ["fp16", "int8"]
    with pytest.raises(ProtocolError):  # a free block holds no page, hence no format
        st.apply({"v": 2, "step": 2, "events": [
            {"kind": "quantize", "tier": "gpu", "blocks": [5], "format": "int8"}]})


def test_a_freed_block_reverts_to_the_tier_format():
    st = KVState()
    st.apply({"v": 2, "step": 0, "events": [
        {"kind": "tier_init", "tier": "gpu", "num_blocks": 8, "block_size": 4,
         "format": "fp16"},
        {"kind": "seq_add", "seq": "a"},
        {"kind": "alloc", "tier": "gpu", "seq": "a", "blocks": [2, 3]},
        {"kind": "store", "tier": "gpu", "blocks": [2], "hashes": [77]},
        {"kind": "quantize", "tier": "gpu", "blocks": [2, 3], "format": "int8"}]})
    st.apply({"v": 2, "step": 1, "events": [
        {"kind": "free", "tier": "gpu", "seq": "a", "blocks": [2, 3]}]})
    assert st.canonical()["tiers"]["gpu"]["block_formats"] == {2: "int8"}  # 2 is cached
    st.apply({"v": 2, "step": 2, "events": [
        {"kind": "evict", "tier": "gpu", "blocks": [2]}]})
    assert st.canonical()["tiers"]["gpu"]["block_formats"] == {}


def test_canonical_tolerates_a_producer_without_block_formats_honestly():
    st = KVState()
    st.apply({"v": 2, "step": 0, "events": [
        {"kind": "tier_init", "tier": "gpu", "num_blocks": 4, "block_size": 4}]})
    plain = {"tiers": {"gpu": {"num_blocks": 4, "block_size": 4, "format": "auto",
                               "ref": [0] * 4, "hash": [None] * 4}}, "seqs": {}}
    assert st.canonical() == plain and plain == st.canonical()  # absent means "none"
    st.apply({"v": 2, "step": 1, "events": [
        {"kind": "store", "tier": "gpu", "blocks": [1], "hashes": [5]},
        {"kind": "quantize", "tier": "gpu", "blocks": [1], "format": "int8"}]})
    plain["tiers"]["gpu"]["hash"] = [None, 5, None, None]
    assert st.canonical() != plain and plain != st.canonical()  # a real difference
    plain["tiers"]["gpu"]["block_formats"] = {1: "int8"}
    assert st.canonical() == plain


def test_big_hashes_survive_apply_snapshot_and_rollback():
    st, big = KVState(), 2**64 - 5  # outside int64: a foreign producer's unsigned hash
    st.apply({"v": 2, "step": 0, "events": [
        {"kind": "tier_init", "tier": "gpu", "num_blocks": 4, "block_size": 4},
        {"kind": "store", "tier": "gpu", "blocks": [1, 2], "hashes": [big, -3]}]})
    assert st.canonical()["tiers"]["gpu"]["hash"] == [None, big, -3, None]
    assert KVState.from_snapshot(st.snapshot()).canonical() == st.canonical()
    before = st.canonical()
    with pytest.raises(ProtocolError):
        st.apply({"v": 2, "step": 1, "events": [
            {"kind": "evict", "tier": "gpu", "blocks": [1]},
            {"kind": "evict", "tier": "gpu", "blocks": [3]}]})  # 3 is not cached
    assert st.canonical() == before


def test_batch_consumers_see_every_batch_in_order(tmp_path):
    gen, seen = SyntheticCache(seed=8), []

    def broken(batch: dict) -> None:
        raise RuntimeError("a consumer bug")

    with EventStream(record_path=str(tmp_path / "c.kvtrace"), snapshot_fn=gen.canonical) as s:
        s.add_consumer(lambda b: seen.append((b["seq"], type(b["events"][0]["blocks"])
                                              if b["events"] and "blocks" in b["events"][0]
                                              else list)))
        s.add_consumer(broken)
        for step in range(20):
            s.end_step(step, gen.step(s.sink))
        assert s.wait_idle(HANG_S)
        assert s.stats.consumer_errors == 20
    assert [q for q, _ in seen] == list(range(1, 21))
    assert all(kind is list for _, kind in seen)  # consumers get plain id lists


def test_unpack_ids_short_and_long_forms_agree() -> None:
    """Short packed lists take a struct fast path, long ones array.array: same ids, and
    the same errors for anything that is not whole int32s."""
    for n in (0, 1, 2, 7, 24, 32, 33, 40, 1000):
        ids = [((i * 7919) % 5000) - (2 ** 31 if i % 5 == 0 else 0) for i in range(n)]
        packed = pack_ids(ids)
        assert unpack_ids(packed) == ids
        assert unpack_ids(bytearray(packed)) == ids
        assert unpack_ids(memoryview(packed)) == ids
    for bad in (b"\x01", b"\x01\x02\x03\x04\x05", bytes(131)):
        with pytest.raises(ProtocolError):
            unpack_ids(bad)
