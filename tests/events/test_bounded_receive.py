"""Every consumer receives a message within a limit over all its frames (issue 49,
defect 1): a hostile publisher's message of many frames, a few times the limit in all,
is dropped as it is read, counted, and named (``Subscriber.refused``/``problem``, what
``kvscope inspect``/``record --connect`` and the router show; ``VllmSubscriber``'s
``last_error``), and the stream goes on with the next message. A batch past the mirror's
limits is refused the same way. In process, loopback only; every wait is for an event
(a hang guard fails the test, see ``poll_until``)."""

from __future__ import annotations

import zmq

from kvscope.engine.events import schema as S
from kvscope.engine.events.vllm import kv_events_wire as W
from kvscope.engine.events.vllm.kv_events_subscriber import VllmSubscriber
from kvscope.engine.events.wire import Subscriber
from kvscope.engine.events.wire import codec as C
from kvscope.engine.events.wire.receive import MessageTooLarge, recv_bounded
from tests.events.conftest import poll_until
from tests.events.test_hostile_publisher import TIER, FakePublisher

LIMIT = 64 << 10  # the limit these consumers are given: a hostile message is 4x it
FRAME = b"m" * (16 << 10)


def _hostile(sock: zmq.Socket, head: list[bytes], frames: int = 16) -> None:
    """A message of ``head`` then ``frames`` 16 KiB frames, each but the last saying
    "more follows" (4x LIMIT in all with the default 16)."""
    for f in head:
        sock.send(f, zmq.SNDMORE)
    for i in range(frames):
        sock.send(FRAME, zmq.SNDMORE if i < frames - 1 else 0)


def test_recv_bounded_drops_a_message_past_either_limit_and_keeps_the_next() -> None:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        a.bind("tcp://127.0.0.1:*")
        b.connect(a.getsockopt_string(zmq.LAST_ENDPOINT))
        _hostile(a, [b"head"])
        a.send_multipart([b""] * 9)  # small, but one frame more than the limit
        a.send_multipart([b"ok", b"fine"])
        b.poll(-1)
        try:
            recv_bounded(b, LIMIT)
        except MessageTooLarge as e:
            assert f"more than {LIMIT} bytes" in str(e) and "17 frames" in str(e)
        else:
            raise AssertionError("a message of 4x the limit was taken")
        try:
            recv_bounded(b, LIMIT, max_frames=8)
        except MessageTooLarge as e:
            assert "more than 8 frames" in str(e)
        else:
            raise AssertionError("a message of 9 frames was taken")
        assert recv_bounded(b, LIMIT) == [b"ok", b"fine"]  # at the next one's start
    finally:
        a.close(linger=0)
        b.close(linger=0)
        ctx.term()


def _connected(fake: FakePublisher, sub: Subscriber) -> None:
    def heard() -> bool:  # heartbeats until the SUB is surely connected
        fake.serve()
        fake.pub.send_multipart(fake.codec.encode_frames(
            C.make_heartbeat("fake", fake.seq, 0.0)))
        return sub.status == "connected"

    poll_until([sub], heard)


def test_the_subscriber_drops_a_message_past_the_limit_and_says_why() -> None:
    """What inspect, record and the router receive through: the hostile message (its
    frames 4x the limit in all) is dropped and named; the next batch is applied."""
    fake = FakePublisher()
    sub = Subscriber(fake.endpoint, fake.snapshot_endpoint, stale_after_s=30,
                     max_bytes=LIMIT)
    try:
        _connected(fake, sub)
        _hostile(fake.pub, [C.TOPIC, (1).to_bytes(8, "big")])
        fake.batch([TIER])  # seq 1, good
        poll_until([sub], lambda: (fake.serve(), sub.last_seq >= 1)[1])
        assert sub.codec.errors["size"] == 1 and sub.errors == 1
        assert sub.refused is not None and f"more than {LIMIT} bytes" in sub.refused
        assert sub.problem == sub.refused
        assert sub.state.tiers["gpu"].num_blocks == 8
    finally:
        sub.close()
        fake.close()


def test_the_subscriber_refuses_a_batch_past_the_mirrors_limits() -> None:
    """192 pools in one batch, together past MAX_TOTAL_BLOCKS: refused by the mirror,
    named, and the state is the publisher's again from a snapshot."""
    from kvscope.engine.events.state import MAX_TOTAL_BLOCKS

    fake = FakePublisher()
    sub = Subscriber(fake.endpoint, fake.snapshot_endpoint, stale_after_s=30)
    try:
        _connected(fake, sub)
        fake.batch([TIER])
        poll_until([sub], lambda: (fake.serve(), sub.last_seq >= 1)[1])
        pools = [{"kind": "tier_init", "tier": t, "group": g, "block_size": 16,
                  "num_blocks": MAX_TOTAL_BLOCKS // 192 + 1} for t in S.TIERS
                 for g in range(64)]
        fake.batch(pools, apply=False)
        poll_until([sub], lambda: (fake.serve(), sub.resyncs >= 1)[1])
        assert sub.apply_errors == 1 and sub.refused is not None
        assert f"at most {MAX_TOTAL_BLOCKS} blocks" in sub.refused
        assert set(sub.state.tiers) == {"gpu"}
    finally:
        sub.close()
        fake.close()


def test_the_vllm_reader_drops_a_message_past_the_limit() -> None:
    enc = W.Encoder()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    sub = VllmSubscriber("tcp://127.0.0.1:0", bind=True, max_bytes=LIMIT)
    try:
        pub.connect(sub.endpoint)
        seq = 0
        got = None
        while got is None:  # slow joiner: empty batches until one arrives
            pub.send_multipart([b"", W.encode_seq(seq), enc.encode(0.0, [])])
            got = sub.recv(0.05)
            seq += 1
        _hostile(pub, [b"", W.encode_seq(seq)])
        pub.send_multipart([b"", W.encode_seq(seq + 1), enc.encode(1.0, [])])
        while got.seq < seq + 1:
            nxt = sub.recv(5.0)
            assert nxt is not None, (sub.errors, sub.last_error)
            got = nxt
        assert sub.errors == 1 and f"more than {LIMIT} bytes" in sub.last_error
    finally:
        sub.close()
        pub.close(linger=0)
        ctx.term()


def test_the_vllm_prefix_index_refuses_a_batch_past_its_limit(monkeypatch) -> None:
    """What --connect-vllm builds from the stream: a batch whose stores would pass
    MAX_HASHES is refused whole, the index as it was; a clear makes room again."""
    from kvscope.engine.events.vllm import prefix_cache as P

    cache = P.VllmPrefixCache()
    flood = [W.block_stored(list(range(P.MAX_HASHES + 1)), None, [], 16, None)]
    try:
        cache.apply(0.0, flood, 0)
    except P.IndexFull as e:
        assert f"past {P.MAX_HASHES} hashes" in str(e)
    else:
        raise AssertionError("a store of MAX_HASHES + 1 hashes was applied")
    assert cache.media == {} and cache.batches == 0 and cache.timeline == []

    monkeypatch.setattr(P, "MAX_HASHES", 10)
    cache.apply(1.0, [W.block_stored(list(range(8)), None, [], 16, None)], 1)
    held = {m: dict(d) for m, d in cache.media.items()}
    more = [W.block_stored([100, 101, 102], None, [], 16, None)]
    try:
        cache.apply(2.0, more, 2)
    except P.IndexFull:
        pass
    else:
        raise AssertionError("a batch past the index's limit was applied")
    assert cache.media == held and cache.batches == 1 and len(cache.timeline) == 1
    cache.apply(3.0, [W.all_blocks_cleared(), *more], 3)  # cleared first: room again
    assert sum(map(len, cache.media.values())) == 3
