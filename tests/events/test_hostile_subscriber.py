"""Clients that flood the snapshot/replay endpoint, or never read their replies: the
engine keeps stepping, snapshots are coalesced, replays are bounded, and a well-behaved
subscriber next to them stays exact."""

from __future__ import annotations

import itertools

import zmq

from kvscope.engine.bench.synthetic import SyntheticCache
from kvscope.engine.events import KVState
from kvscope.engine.events.wire import Subscriber
from kvscope.engine.events.wire import codec as C
from kvscope.engine.events.wire.publisher import (
    MAX_REQUESTS_PER_ROUND,
    MAX_REQUESTS_PER_S,
    Publisher,
)
from tests.events.conftest import cache_stream, poll_until, synced_to
from tests.events.test_live_stream import run_steps
from tests.waiting import wait_until

EP = "tcp://127.0.0.1:0"


def _flooder(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A DEALER that asks and never reads (its receive queue holds one message)."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.setsockopt(zmq.SNDHWM, 0)  # queue every request: the flood is the test
    s.connect(endpoint)
    return s


def _ask(sock: zmq.Socket, mtype: str, rid: int, **fields: object) -> None:
    sock.send(C.Codec().encode(C.make_request(mtype, id=rid, **fields)))


def test_snapshot_and_replay_floods_neither_stop_the_engine_nor_hurt_a_subscriber():
    gen = SyntheticCache(seed=21)
    # one client snapshot per hour: the whole test sits inside one interval
    with cache_stream(gen, EP, heartbeat_s=0.2, replay_size=256,
                      snapshot_interval_s=3600) as stream, \
            Subscriber(stream.endpoint, stream.snapshot_endpoint) as good:
        stream.publisher._replay_rate = 0.0  # the replay budget never refills
        stream.publisher.max_requests_per_s = 1e9  # read the whole flood (see below)
        poll_until([good], synced_to([good], 0))
        ctx = zmq.Context()
        flooders = [_flooder(ctx, stream.snapshot_endpoint) for _ in range(3)]
        sent = 0
        try:
            for _ in range(100):
                for i, f in enumerate(flooders):
                    for _k in range(10):
                        if i == 2:
                            _ask(f, C.MSG_REPLAY, sent, **{"from": 1})
                        else:
                            _ask(f, C.MSG_GET_SNAPSHOT, sent)
                        sent += 1
                run_steps(stream, gen, 1, [good])  # every step: the mirror is exact
            wait_until(lambda: stream.publisher.requests_received >= sent + 1,
                       "the publisher to read every request")
            run_steps(stream, gen, 1, [good])
            st = stream.stats
        finally:
            for f in flooders:
                f.close()
            ctx.term()
        assert stream.seq == 101 and good.errors == 0 and good.gaps == 0
        assert st.dropped_batches == 0
        # 2000 snapshot requests, one cache snapshot: the good subscriber's first one
        assert st.snapshots_taken == 1
        # 1000 replays of up to 100 batches against a budget of 256 batches
        assert st.replays_served <= 256 and st.replays_refused >= 1000 - 256


def test_a_client_that_never_reads_loses_replies_and_nobody_waits():
    pub = Publisher(EP, None, "e", replay_size=8)
    pub._router.setsockopt(zmq.SNDBUF, 4096)
    pub._clock = itertools.count().__next__  # a second passes per replay: full budget
    ctx = zmq.Context()
    slow = _flooder(ctx, pub.snapshot_endpoint)
    good = ctx.socket(zmq.DEALER)
    good.setsockopt(zmq.LINGER, 0)
    good.connect(pub.snapshot_endpoint)
    try:
        for seq in range(1, 9):
            pub.publish(seq, C.Codec().encode(
                C.make_batch("e", seq, seq, 0.0, [], {"pad": "x" * 4096})))
        rid = itertools.count()

        def flooded() -> bool:
            for _ in range(50):
                _ask(slow, C.MSG_REPLAY, next(rid), **{"from": 1})
            pub.serve_requests()  # returns: a full queue fails the send, never blocks
            return pub.replies_dropped > 0

        wait_until(flooded, "the slow client's queue to fill")
        # the well-behaved client still gets its whole replay
        _ask(good, C.MSG_REPLAY, 7, **{"from": 1})
        replies: list[dict] = []
        codec = C.Codec()

        def answered() -> bool:
            pub.serve_requests()
            while good.poll(0):
                replies.append(codec.decode(good.recv()))
            return bool(replies) and replies[-1]["type"] == C.MSG_REPLAY_END

        wait_until(answered, "the good client's replay")
        assert [r["seq"] for r in replies[:-1]] == list(range(1, 9)), replies[-1].get("reason")
        assert replies[-1]["ok"] and replies[-1]["id"] == 7
    finally:
        slow.close()
        good.close()
        ctx.term()
        pub.close()


def test_one_snapshot_encoding_answers_every_waiter_with_its_own_id():
    pub = Publisher(EP, None, "e")
    ctx = zmq.Context()
    clients = []
    try:
        for _ in range(3):
            c = ctx.socket(zmq.DEALER)
            c.setsockopt(zmq.LINGER, 0)
            c.connect(pub.snapshot_endpoint)
            clients.append(c)
        for i, c in enumerate(clients):
            _ask(c, C.MSG_GET_SNAPSHOT, f"req-{i}")
        wait_until(lambda: pub.serve_requests() == 3, "three waiting snapshot requests")
        pub.answer_snapshots(0, KVState().snapshot())
        codec = C.Codec()
        for i, c in enumerate(clients):
            msg = codec.decode(c.recv())
            assert msg["type"] == C.MSG_SNAPSHOT and msg["id"] == f"req-{i}"
            assert KVState.from_snapshot(msg["state"]).canonical() == KVState().canonical()
    finally:
        for c in clients:
            c.close()
        ctx.term()
        pub.close()


def test_requests_are_read_at_a_bounded_rate_and_the_rest_wait():
    pub = Publisher(EP, None, "e")
    now = [0.0]
    pub._clock = lambda: now[0]
    pub._requests_refilled = 0.0
    ctx = zmq.Context()
    flooder = _flooder(ctx, pub.snapshot_endpoint)
    try:
        for i in range(3 * MAX_REQUESTS_PER_ROUND):
            _ask(flooder, C.MSG_REPLAY, i, **{"from": 1})
        wait_until(lambda: (pub.serve_requests(), pub.requests_received)[1] > 0,
                   "the first requests")
        for _ in range(20):  # the clock stands still: the budget does not come back
            pub.serve_requests()
        assert pub.requests_received == MAX_REQUESTS_PER_ROUND
        now[0] = 0.1  # 0.1 s: MAX_REQUESTS_PER_S / 10 more
        wait_until(lambda: (pub.serve_requests(), pub.requests_received)[1]
                   >= MAX_REQUESTS_PER_ROUND + MAX_REQUESTS_PER_S // 10, "the refill")
        assert pub.requests_received == MAX_REQUESTS_PER_ROUND + MAX_REQUESTS_PER_S // 10
    finally:
        flooder.close()
        ctx.term()
        pub.close()
