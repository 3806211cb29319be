"""The router's PrefixIndex follows the mirror exactly, event batch by event batch, and
predicts the engine's own prefix hits; the policies pick as documented."""

from __future__ import annotations

import threading

from kvscope.engine.bench.synthetic import SyntheticCache
from kvscope.engine.cache.hashing import chain_hashes
from kvscope.engine.events.sink import ListSink
from kvscope.engine.events.state import KVState
from kvscope.engine.router.policy import Policy
from kvscope.engine.router.prefix_index import PrefixIndex, prompt_chain
from kvscope.engine.router.replica import Replica, parse_replica


def _mirror_counts(state: KVState) -> dict[int, int]:
    out: dict[int, int] = {}
    for tier in state.tiers.values():
        for h in tier.hashes.values():
            out[h] = out.get(h, 0) + 1
    return out


def test_index_equals_the_mirror_after_every_batch() -> None:
    cache, sink = SyntheticCache(seed=3, gpu_blocks=64, cpu_blocks=32), ListSink()
    state, index = KVState(), PrefixIndex()
    kinds: set[str] = set()
    for step in range(400):
        stats = cache.step(sink)
        batch = {"v": 1, "epoch": "e", "step": step, "time": 0.0, "events": sink.drain(),
                 "stats": stats}
        kinds |= {ev["kind"] for ev in batch["events"]}
        state.apply(batch)
        index.on_batch(batch, state)
        assert dict(index.count) == _mirror_counts(state), f"step {step}"
    # the run exercised every kind that changes a hash
    assert {"store", "evict", "offload", "host_hit", "cow"} <= kinds
    rebuilt = PrefixIndex()
    rebuilt.rebuild(state)
    assert rebuilt.by_block == index.by_block


def test_prompt_chain_is_the_engines_matchable_span() -> None:
    ids = list(range(100, 148))  # 48 tokens = 3 full blocks of 16
    # the engine matches at most all but the last token: 47 tokens -> 2 full blocks
    assert prompt_chain(ids, 16) == chain_hashes(ids, 16)[:2]
    assert prompt_chain(ids + [7], 16) == chain_hashes(ids, 16)
    index = PrefixIndex()
    index.count.update(chain_hashes(ids, 16)[:1])
    assert index.matched_blocks(prompt_chain(ids + [7], 16)) == 1
    index.count.update(chain_hashes(ids, 16)[2:])  # a hole at block 1: the chain stops
    assert index.matched_blocks(prompt_chain(ids + [7], 16)) == 1


def _replica(name: str, cached: list[int] | None = None, load: int = 0) -> Replica:
    r = Replica(name, f"http://127.0.0.1:1/{name}")
    r.healthy, r.in_flight, r.block_size = True, load, 16

    class FakeSub:  # a replica whose index is given (the live tests use real streams)
        status = "connected"
        lock = threading.Lock()

    r.sub = FakeSub()
    r.index.count.update(cached or [])
    return r


def test_policies() -> None:
    ids = list(range(200, 264))  # 4 blocks; 3 matchable
    chain = chain_hashes(ids, 16)
    a, b, c = _replica("a", chain[:1]), _replica("b", chain[:3]), _replica("c")
    prefix = Policy("prefix", load_cost_tokens=32)
    # work to do: a 64 - 16 = 48, b 64 - 48 = 16, c 64 tokens
    d = prefix.choose([a, b, c], ids)
    assert (d.replica.name, d.predicted_cached_tokens, d.reason) == ("b", 48, "prefix")
    b.in_flight = 3  # b: 16 + 3 x 32 = 112 > a's 48: the shorter hit on an idle replica
    d = prefix.choose([a, b, c], ids)
    assert (d.replica.name, d.predicted_cached_tokens) == ("a", 16)
    a.in_flight = 3  # a: 144, b: 112, c: 64 (nothing cached, but idle)
    assert prefix.choose([a, b, c], ids).replica.name == "c"
    assert prefix.choose([a, b, c], list(range(900, 964))).reason == "least-load"
    b.healthy = False
    a.in_flight = 0
    assert {prefix.choose([a, b, c], None).replica.name for _ in range(4)} == {"a", "c"}
    rr = Policy("round-robin")
    assert [rr.choose([a, c], ids).replica.name for _ in range(4)] == ["a", "c", "a", "c"]
    c.healthy = a.healthy = False
    assert Policy("least-load").choose([a, b, c], ids) is None


def test_parse_replica() -> None:
    assert parse_replica("http://h:1/,tcp://h:2") == ("http://h:1", "tcp://h:2", None)
    assert parse_replica("http://h:1,tcp://h:2,tcp://h:9")[2] == "tcp://h:9"
    for bad in ("h:1", "http://h:1,", "http://h:1,a,b,c"):
        try:
            parse_replica(bad)
        except ValueError as e:
            assert "URL[,EVENTS" in str(e)
        else:
            raise AssertionError(bad)


def test_index_from_column_frames_equals_the_per_event_index(monkeypatch) -> None:  # noqa: ANN001
    """Protocol 3: fed the decoded column frames (every hot step as columns), the index
    equals the one fed the same steps' events, and the mirror, after every batch."""
    from kvscope.engine.events import state_columns
    from kvscope.engine.events.wire import codec as C

    monkeypatch.setattr(state_columns, "SMALL_RUN", 0)  # every step with ids as columns
    monkeypatch.setattr(state_columns, "BULK_IDS", 0)
    codec = C.Codec()
    cache, sink = SyntheticCache(seed=4, gpu_blocks=64, cpu_blocks=32), ListSink()
    state, cols_index, ev_index = KVState(), PrefixIndex(), PrefixIndex()
    n_cols = 0
    for step in range(300):
        stats = cache.step(sink)
        batch = codec.decode(codec.encode(C.make_batch("e", step + 1, step, 0.0, sink.drain(),
                                                       stats)))
        n_cols += "columns" in batch
        state.apply(batch)
        cols_index.on_batch(batch, state)
        ev_index.on_batch({k: v for k, v in batch.items() if k != "columns"}, state)
        assert cols_index.by_block == ev_index.by_block, f"step {step}"
        assert dict(cols_index.count) == dict(ev_index.count) == _mirror_counts(state)
    assert n_cols > 250
