"""vLLM's KV-event contract: the byte layout, the translation from kvscope's events (the
consumer's hash set per medium equals the KVState mirror's after every step, parents
chain with kvscope's hashing), the ZeroMQ publisher in both socket directions, replay,
and bad input."""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import pytest
import zmq

from kvscope.engine.bench.event_workloads import ManagerWorkload
from kvscope.engine.cache import KVCacheManager
from kvscope.engine.cache.hashing import NO_SALT_ROOT
from kvscope.engine.events import KVState
from kvscope.engine.events.sink import ListSink
from kvscope.engine.events.vllm import kv_events_wire as W
from kvscope.engine.events.vllm.config import KVEventsConfig
from kvscope.engine.events.vllm.kv_events_publisher import VllmPublisher, is_bind_endpoint
from kvscope.engine.events.vllm.kv_events_subscriber import VllmSubscriber
from kvscope.engine.events.vllm.prefix_cache import VllmPrefixCache
from kvscope.engine.events.vllm.translate import MEDIUM, VllmTranslator
from kvscope.engine.events.wire import EventStream
from kvscope.engine.events.wire.codec import make_batch
from tests.events.slow_joiner import publish_until_received
from tests.waiting import HANG_MS, HANG_S

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32.0-kv-events.vllmtrace"


def test_payload_layout_is_msgspecs():
    events = [W.block_stored([11, 12], None, list(range(32)), 16, "GPU"),
              W.block_removed([11], "GPU"), W.all_blocks_cleared()]
    raw = msgpack.unpackb(W.Encoder().encode(1.5, events, 0), raw=False)
    assert isinstance(raw, list) and raw[0] == 1.5 and raw[2] == 0  # array_like EventBatch
    stored, removed, cleared = raw[1]
    # as vLLM 0.32 writes them (keys and order of the committed real capture)
    assert list(stored) == ["type", "block_hashes", "parent_block_hash", "token_ids",
                            "block_size", "lora_id", "medium", "lora_name", "extra_keys",
                            "group_idx", "kv_cache_spec_kind"]
    assert stored["type"] == "BlockStored" and stored["parent_block_hash"] is None
    assert stored["extra_keys"] == [None, None] and stored["group_idx"] == 0
    assert list(removed) == ["type", "block_hashes", "medium", "group_idx"]
    assert cleared == {"type": "AllBlocksCleared"}
    # the rank is a trailing default: left out when None (omit_defaults)
    assert len(msgpack.unpackb(W.Encoder().encode(2.0, [], None))) == 2
    back = W.decode(W.Encoder().encode(1.5, events, 0))
    assert back["ts"] == 1.5 and back["data_parallel_rank"] == 0
    assert back["events"] == [W._ordered(e) for e in events]
    assert W.decode_seq(W.encode_seq(-1)) == -1 and W.decode_seq(W.encode_seq(7)) == 7
    plain = W.Encoder().encode(1.0, [{"type": "BlockRemoved", "block_hashes": [1],
                                      "medium": None}], None)
    assert list(msgpack.unpackb(plain)[1][0]) == ["type", "block_hashes", "medium"]  # omitted


def test_payload_is_what_msgspec_writes_for_the_typed_events():
    """The hand encoder writes, byte for byte, what msgspec (as vLLM) writes for the same
    events as their declared types: tag first, declared order, None defaults left out."""
    import msgspec

    events = [W.block_stored([11, 12], 10, list(range(32)), 16, "GPU"),
              W.block_stored([13], None, list(range(16)), 16, None),
              W.block_removed([11], "CPU"), W.all_blocks_cleared()]
    typed = msgspec.convert(events, list[W.BlockStored | W.BlockRemoved | W.AllBlocksCleared])
    for rank in (0, None):
        body = [1.5, typed] + ([] if rank is None else [rank])
        assert W.Encoder().encode(1.5, events, rank) == msgspec.msgpack.encode(body)


def test_layout_equals_the_real_vllm_capture():
    """Every event of the committed vLLM 0.32 capture has exactly the keys, in the order,
    that kvscope's encoder writes for the same event."""
    from kvscope.engine.events.vllm.kv_events_recording import read_messages

    _, messages = read_messages(FIXTURE)
    seen = set()
    for _, _, _, payload in messages:
        raw = msgpack.unpackb(payload, raw=False)
        assert len(raw) == 3 and raw[2] == 0
        for ev in raw[1]:
            ours = W._ordered({**ev})
            assert list(ev) == list(ours) and ev == ours
            seen.add(ev["type"])
            if ev["type"] == W.BLOCK_STORED:
                mine = W.block_stored(ev["block_hashes"], ev["parent_block_hash"],
                                      ev["token_ids"], ev["block_size"], ev["medium"])
                assert msgpack.packb(W._ordered(mine)) == msgpack.packb(ev)
            if ev["type"] == W.BLOCK_REMOVED:
                mine = W.block_removed(ev["block_hashes"], ev["medium"])
                assert msgpack.packb(W._ordered(mine)) == msgpack.packb(ev)
    assert seen == {W.BLOCK_STORED, W.BLOCK_REMOVED}


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb({"ts": 1}), msgpack.packb([1]),
                                     msgpack.packb([1.0, [{"block_hashes": []}]]),
                                     msgpack.packb([1.0, [{"type": "BlockStored",
                                                           "block_hashes": ["x"]}]])])
def test_decoder_rejects_what_is_not_the_contract(payload):
    with pytest.raises(W.VllmWireError):
        W.decode(payload)


def test_config_keys_are_vllms():
    c = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "ipc:///x"}')
    assert c.enabled and c.publisher == "zmq" and c.buffer_steps == 10_000 and c.topic == ""
    assert not KVEventsConfig.from_json("{}").enabled
    for bad in ('{"enable_kv_cache_events": true, "endpoit": "x"}', "[1]", "nope",
                '{"publisher": "kafka"}', '{"buffer_steps": 0}'):
        with pytest.raises(ValueError):
            KVEventsConfig.from_json(bad)
    assert is_bind_endpoint("tcp://*:5557") and is_bind_endpoint("ipc:///tmp/x")
    assert not is_bind_endpoint("tcp://127.0.0.1:5557")


def _check_chain(ev: dict, bs: int) -> None:
    """kvscope's hash of each stored block is hash((parent's hash, its tokens)), the first
    block's parent being the unsalted root when parent_block_hash is None."""
    parent = ev["parent_block_hash"]
    parent = NO_SALT_ROOT if parent is None else parent
    toks = ev["token_ids"]
    assert len(toks) == bs * len(ev["block_hashes"])
    for i, h in enumerate(ev["block_hashes"]):
        assert h == hash((parent, tuple(toks[i * bs:(i + 1) * bs])))
        parent = h


def test_translation_equals_the_mirror_every_step():
    """The real cache manager (with a host tier: offload and host hits) through the
    translator, the encoder and the decoder: a vLLM consumer's hashes per medium equal
    the KVState mirror's cached hashes per tier after every step."""
    sink = ListSink()
    sink.store_detail = True
    manager = KVCacheManager(48, 16, num_cpu_blocks=32, sink=sink)
    work = ManagerWorkload(manager, seed=5, max_running=12)
    mirror, tr, consumer, enc = KVState(), VllmTranslator(), VllmPrefixCache(), W.Encoder()
    kinds, vkinds = set(), set()
    ever: dict[str, set[int]] = {"GPU": set(), "CPU": set()}
    for seq in range(250):
        stats = work.step() if seq else {}
        batch = make_batch("e", seq, seq, float(seq), sink.drain(), stats)
        mirror.apply(batch)
        kinds.update(e["kind"] for e in batch["events"])
        out = W.decode(enc.encode(batch["time"], tr.translate(batch), 0))
        for ev in out["events"]:
            vkinds.add(ev["type"])
            if ev["type"] == W.BLOCK_STORED:
                _check_chain(ev, 16)
                parent = ev["parent_block_hash"]
                # a parent was announced before its child (it may have left since: a
                # dedup'd parent whose indexed copy was evicted; CPU: the gpu copy)
                assert parent is None or parent in ever[ev["medium"]] | ever["GPU"]
                ever.setdefault(ev["medium"], set()).update(ev["block_hashes"])
        consumer.apply(out["ts"], out["events"], seq)
        for tier, t in mirror.tiers.items():
            assert consumer.hashes(MEDIUM[tier]) == set(t.hashes.values()), (seq, tier)
    assert {"store", "evict", "offload", "host_hit"} <= kinds
    assert {W.BLOCK_STORED, W.BLOCK_REMOVED} <= vkinds
    assert consumer.unknown_removed == 0 and tr.undescribed == 0
    assert consumer.summary()["prefixes"] > 0


def test_translation_of_a_hybrid_cache_names_its_window_group():
    """A hybrid cache with prefix caching (engine.cache.window_group): the window group's
    index goes out as group_idx 1 on the same medium, kind "sliding_window"; a consumer's
    hashes per (medium, group) equal the mirror's per pool after every step, swaps to the
    cpu tier (each group's own host pool, its copies indexed there) included."""
    import random

    sink = ListSink()
    sink.store_detail = True
    m = KVCacheManager(40, 4, sink=sink, window=8, num_window_blocks=14, num_cpu_blocks=24,
                       num_window_cpu_blocks=10)
    mirror, tr, consumer, enc = KVState(), VllmTranslator(), VllmPrefixCache(), W.Encoder()
    rng = random.Random(3)
    prefixes = [[rng.randrange(40) for _ in range(20)] for _ in range(2)]
    live: list[str] = []
    swapped: list[str] = []
    groups: set[tuple[int, str]] = set()
    for seq in range(120):
        if seq:
            if live and rng.random() < 0.2:
                sid = live.pop(0)
                if m.preempt(sid, "swap") == "swap":
                    swapped.append(sid)
                else:
                    m.finish(sid, "abort")
            elif swapped and m.can_swap_in(swapped[0], 1):
                m.swap_in(swapped[0])
                live.append(swapped.pop(0))
            if len(live) < 3 and rng.random() < 0.4:
                sid = f"s{seq}"
                prompt = rng.choice(prefixes) + [rng.randrange(40) for _ in range(3)]
                m.add_sequence(sid, prompt)
                k = m.match_prefix(sid)
                if m.allocate_slots(sid, len(prompt) - k) is None:
                    m.finish(sid, "abort")
                else:
                    m.start(sid)
                    live.append(sid)
            for sid in list(live):
                if rng.random() < 0.15 or m.allocate_slots(sid, 1) is None:
                    m.finish(sid, "stop")
                    live.remove(sid)
                else:
                    m.append_token_ids(sid, [rng.randrange(40)])
            m.flush_step_events()
        batch = make_batch("e", seq, seq, float(seq), sink.drain(), {})
        mirror.apply(batch)
        out = W.decode(enc.encode(batch["time"], tr.translate(batch), 0))
        for ev in out["events"]:
            if ev["type"] == W.BLOCK_STORED:
                _check_chain(ev, 4)
                groups.add((ev["group_idx"], ev["kv_cache_spec_kind"]))
        consumer.apply(out["ts"], out["events"], seq)
        for tier in ("gpu", "gpu/1", "cpu", "cpu/1"):
            assert consumer.hashes(tier.upper()) == set(
                mirror.tiers[tier].hashes.values()), (seq, tier)
    assert groups == {(0, "full_attention"), (1, "sliding_window")}
    assert m.window_host.num_swap_ins > 0 and mirror.tiers["cpu/1"].hashes
    assert m.window.pool.num_evictions > 0 and consumer.unknown_removed == 0


def _drive(stream: EventStream, sub: VllmSubscriber, cache: VllmPrefixCache, steps: int,
           seed: int = 2) -> KVState:
    """Probe steps until ``sub`` hears the publisher (slow_joiner.py), then ``steps``
    workload steps; the truth is the manager's own snapshot."""
    manager = KVCacheManager(40, 16, sink=stream.sink)
    stream.end_step(0, {})

    def received() -> bool:  # a bound subscriber also sends its subscription in recv()
        b = sub.recv(0.005)
        if b is not None:
            cache.apply(b.ts, b.events, b.seq)
        return b is not None

    first = publish_until_received(stream, manager, received, step=1)
    work = ManagerWorkload(manager, seed=seed, max_running=10)
    for step in range(first, first + steps):
        stream.end_step(step, work.step())
    return KVState.from_canonical(manager.snapshot())


def _collect(sub: VllmSubscriber, pub: VllmPublisher, cache: VllmPrefixCache) -> None:
    """Everything published, applied in order (the hang guard only fails a stuck run)."""
    end = time.monotonic() + HANG_S
    while sub.last_seq != pub.seq:
        assert time.monotonic() < end, (sub.last_seq, pub.seq)
        for b in sub.batches(timeout_s=0.2):
            cache.apply(b.ts, b.events, b.seq)


@pytest.mark.parametrize("publisher_binds", [True, False])
def test_publisher_both_directions_and_replay(tmp_path, publisher_binds):
    if publisher_binds:  # vLLM's default shape: PUB binds, the consumer connects
        endpoint = f"ipc://{tmp_path}/pub"
        sub = VllmSubscriber(endpoint, replay_endpoint=f"ipc://{tmp_path}/replay",
                             replay_timeout_s=HANG_S)
    else:  # PUB given a concrete tcp address connects: the consumer binds it
        sub = VllmSubscriber("tcp://127.0.0.1:0", bind=True,
                             replay_endpoint=f"ipc://{tmp_path}/replay",
                             replay_timeout_s=HANG_S)
        endpoint = sub.endpoint
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint,
                         replay_endpoint=f"ipc://{tmp_path}/replay", topic="kv")
    pub = VllmPublisher(cfg)
    cache = VllmPrefixCache()
    with sub, EventStream(consumers=[pub]) as stream:
        truth = _drive(stream, sub, cache, 120)
        assert stream.wait_idle(HANG_S) and pub.wait_idle(HANG_S)
        _collect(sub, pub, cache)
        assert sub.errors == 0 and sub.missed == 0
        assert cache.hashes("GPU") == set(truth.tiers["gpu"].hashes.values())
        assert cache.unknown_removed == 0
        # replay from seq 0 returns every batch, byte for byte what PUB sent
        replayed = sub._replay(0, pub.seq + 1)
        assert [b.seq for b in replayed] == list(range(pub.seq + 1))
        again = VllmPrefixCache()
        for b in replayed:
            again.apply(b.ts, b.events, b.seq)
        assert again.media == cache.media


def test_subscriber_survives_garbage_and_fills_gaps_by_replay(tmp_path):
    ctx = zmq.Context.instance()
    # an XPUB is a PUB that also hands over each subscription: the test knows when the
    # subscriber's has arrived (slow joiner), and nothing it publishes after is lost
    pub, router = ctx.socket(zmq.XPUB), ctx.socket(zmq.ROUTER)
    pub.bind(f"ipc://{tmp_path}/p")
    router.bind(f"ipc://{tmp_path}/r")
    enc = W.Encoder()
    payloads = {s: enc.encode(float(s), [W.block_stored([s], None, [0] * 4, 4, "GPU")])
                for s in range(4)}
    with VllmSubscriber(f"ipc://{tmp_path}/p", replay_endpoint=f"ipc://{tmp_path}/r",
                        replay_timeout_s=HANG_S) as sub:
        assert pub.poll(HANG_MS) and pub.recv() == b"\x01"  # subscribed to everything
        pub.send_multipart([b"", W.encode_seq(0), payloads[0]])
        pub.send_multipart([b"", W.encode_seq(1), b"\xc1garbage"])
        pub.send_multipart([b"", b"short"])
        assert sub.recv(HANG_S).seq == 0
        pub.send_multipart([b"", W.encode_seq(3), payloads[3]])  # 1 and 2 missing
        got = []

        def serve():  # answer the replay the subscriber sends on the gap
            if router.poll(HANG_MS):
                client, _, start = router.recv_multipart()
                for s in range(W.decode_seq(start), 4):
                    router.send_multipart([client, b"", b"", W.encode_seq(s), payloads[s]])
                router.send_multipart([client, b"", b"", W.encode_seq(-1), b""])

        import threading

        t = threading.Thread(target=serve)
        t.start()
        got = [sub.recv(HANG_S).seq for _ in range(3)]
        t.join()
        assert got == [1, 2, 3] and sub.gaps == 1 and sub.missed == 0
        assert sub.errors == 2 and "frames" in sub.last_error
        pub.send_multipart([b"", W.encode_seq(0), payloads[0]])  # a restarted publisher
        assert sub.recv(HANG_S).restarted and sub.restarts == 1
    pub.close(0)
    router.close(0)


@pytest.mark.parametrize("bad", ['{"enable_kv_cache_events": true, "endpont": "x"}',
                                 "{not json", '{"publisher": "kafka"}'])
def test_serve_refuses_a_bad_kv_events_config_before_loading(bad, capsys):
    from kvscope.engine.cli import main

    assert main(["serve", "--kv-events-config", bad]) == 2
    assert "kv-events-config" in capsys.readouterr().err


def test_prefix_cache_keeps_vllm_kv_cache_groups_apart():
    """A hybrid model's vLLM stores the same hashes in its full-attention group (0) and
    its sliding-window group (1); removing them from group 1 (out of the window) leaves
    group 0's index whole."""
    from kvscope.engine.events.vllm import kv_events_wire as W
    from kvscope.engine.events.vllm.prefix_cache import VllmPrefixCache

    pc = VllmPrefixCache()
    full = W.block_stored([11, 12], None, list(range(8)), 4, "GPU")
    window = {**full, "group_idx": 1, "kv_cache_spec_kind": "sliding_window"}
    pc.apply(1.0, [full, window])
    assert pc.hashes("GPU") == pc.hashes("GPU/1") == {11, 12}
    assert pc.duplicates == 0
    pc.apply(2.0, [{W.TAG: W.BLOCK_REMOVED, "block_hashes": [11], "medium": "GPU",
                    "group_idx": 1}])
    assert pc.hashes("GPU") == {11, 12} and pc.hashes("GPU/1") == {12}
    assert pc.unknown_removed == 0
