"""A publisher that sends garbage: every bad frame is counted and skipped, the
subscriber keeps its state and goes on applying the good ones."""

from __future__ import annotations

import msgpack
import zmq

from kvscope.engine.events import KVState
from kvscope.engine.events.wire import Subscriber
from kvscope.engine.events.wire import codec as C
from tests.events.conftest import poll_until

TIER = {"kind": "tier_init", "tier": "gpu", "num_blocks": 8, "block_size": 16}


class FakePublisher:
    """Raw PUB + ROUTER sockets driven by the test, speaking the protocol by hand."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.pub, self.router = self.ctx.socket(zmq.PUB), self.ctx.socket(zmq.ROUTER)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.snapshot_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.codec, self.state, self.seq, self.requests = C.Codec(), KVState(), 0, 0

    def serve(self) -> None:
        while self.router.poll(0):
            ident, body = self.router.recv_multipart()
            req = msgpack.unpackb(body)
            self.requests += 1
            if req["type"] == C.MSG_GET_SNAPSHOT:
                reply = {**C.make_snapshot("fake", self.seq, self.state.snapshot()),
                         "id": req["id"]}
            else:
                reply = C.make_request(C.MSG_REPLAY_END, epoch="fake", ok=False,
                                       id=req["id"])
            self.router.send_multipart([ident, self.codec.encode(reply)])

    def batch(self, events: list[dict], apply: bool = True) -> None:
        self.seq += 1
        b = C.make_batch("fake", self.seq, self.seq, 0.0, events)
        if apply:
            self.state.apply(b)
        self.pub.send_multipart(self.codec.encode_frames(b))

    def close(self) -> None:
        self.pub.close()
        self.router.close()
        self.ctx.term()


def test_malformed_frames_are_counted_and_skipped():
    fake = FakePublisher()
    sub = Subscriber(fake.endpoint, fake.snapshot_endpoint, stale_after_s=30)
    try:
        def heard() -> bool:  # heartbeats until the SUB is surely connected
            fake.serve()
            fake.pub.send_multipart(fake.codec.encode_frames(
                C.make_heartbeat("fake", fake.seq, 0.0)))
            return sub.status == "connected"

        poll_until([sub], heard)
        seq8 = (1).to_bytes(8, "big")
        bad_frames = [
            [C.TOPIC, seq8, b"\xc1\xc1 garbage"],
            [C.TOPIC, seq8, msgpack.packb({**C.make_batch("fake", 1, 1, 0.0, []), "v": 99})],
            [C.TOPIC, seq8, msgpack.packb(C.make_batch("fake", 1, 1, 0.0, [TIER]))[:-4]],
            [C.TOPIC, seq8, b"\x81\xa1v\xdd\xff\xff\xff\xff"],  # 4G-element array declared
            [C.TOPIC, seq8, b"\xdf\xff\xff\xff\xff"],  # 4G-entry map declared
            [C.TOPIC, b"\x01", msgpack.packb(C.make_batch("fake", 1, 1, 0.0, []))],
            [C.TOPIC, seq8],
        ]
        for frames in bad_frames:
            fake.pub.send_multipart(frames)
        fake.batch([TIER])  # seq 1, good
        poll_until([sub], lambda: (fake.serve(), sub.last_seq >= 1)[1])
        assert sub.codec.num_errors == len(bad_frames)
        assert set(sub.codec.errors) == {"msgpack", "envelope", "frames"}
        assert sub.state.canonical() == fake.state.canonical()
        assert sub.state.tiers["gpu"].num_blocks == 8

        # Well-formed but impossible (alloc for a sequence nobody added): rejected by the
        # mirror, counted, state kept; the subscriber re-snapshots and carries on.
        fake.batch([{"kind": "alloc", "tier": "gpu", "seq": "ghost", "blocks": [0]}],
                   apply=False)
        fake.batch([{"kind": "seq_add", "seq": "a"}])
        poll_until([sub], lambda: (fake.serve(), sub.last_seq >= 3)[1])
        assert sub.apply_errors == 1 and sub.resyncs >= 1
        assert sub.state.canonical() == fake.state.canonical()

        # Several batches waiting, an impossible one among them: the
        # ones before it are applied, it is refused alone, and until the snapshot comes
        # (nothing is served here) the mirror is exactly as after the last good one.
        fake.batch([{"kind": "seq_start", "seq": "a"}])
        fake.batch([{"kind": "alloc", "tier": "gpu", "seq": "a", "blocks": [0, 1]}])
        good = fake.state.clone()
        fake.batch([{"kind": "alloc", "tier": "gpu", "seq": "a", "blocks": [2]},
                    {"kind": "alloc", "tier": "gpu", "seq": "a", "blocks": [0]}],
                   apply=False)  # block 0 is taken: refused after changing block 2
        fake.batch([{"kind": "seq_add", "seq": "b"}])
        poll_until([sub], lambda: sub.apply_errors == 2)
        assert sub.last_seq == 5 and sub._pending_req[0] == C.MSG_GET_SNAPSHOT
        assert sub.state.canonical() == good.canonical()
        assert sub.state.tiers["gpu"].ref[2] == 0 and sub.state.step == 5
        poll_until([sub], lambda: (fake.serve(), sub.last_seq >= 7)[1])
        assert sub.state.canonical() == fake.state.canonical()
    finally:
        sub.close()
        fake.close()
