"""The event kinds are declared once, as types (engine.events.schema): what the cache
manager emits fits them, the table printed for the docs comes from them, and the id-list
fields the wire packs are the fields they type as block ids."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec

from kvscope.engine.bench.event_workloads import ManagerWorkload
from kvscope.engine.bench.synthetic import SyntheticCache
from kvscope.engine.cache import KVCacheManager
from kvscope.engine.events import causes as C
from kvscope.engine.events import schema as S
from kvscope.engine.events.sink import ListSink
from tests.events.conftest import assert_declared

ROOT = Path(__file__).resolve().parents[2]


def test_the_manager_emits_only_declared_kinds_and_fields():
    sink = ListSink()
    sink.store_detail = True  # parents and tokens on every store
    m = KVCacheManager(48, 4, num_cpu_blocks=32, sink=sink)
    work = ManagerWorkload(m, seed=2, max_running=12, vocab=50)
    kinds: set[str] = set()
    for _ in range(200):
        work.step()
        events = sink.drain()
        assert_declared(events)
        kinds.update(e["kind"] for e in events)
    # a swap preemption with its cause, then the swap back in
    m.add_sequence("x", list(range(12)))
    m.allocate_slots("x", 12)
    m.start("x")
    m.preempt("x", "swap", cause={C.NEEDED_BY: "y", C.BLOCKS_NEEDED: 3, C.FREE_BLOCKS: 0,
                                  C.POLICY: C.PREEMPT_RULE, C.REASON: C.R_ALLOCATE})
    m.swap_in("x")
    m.flush_step_events()
    events = sink.drain()
    assert_declared(events)
    kinds.update(e["kind"] for e in events)
    assert {"tier_init", "seq_add", "alloc", "hit", "store", "evict", "free", "seq_tokens",
            "seq_preempt", "seq_resume", "seq_finish", "swap_out", "swap_in"} <= kinds
    assert any("cause" in e for e in events)


def test_the_synthetic_workload_emits_only_declared_kinds_and_fields():
    gen, sink = SyntheticCache(seed=1), ListSink()
    for _ in range(300):
        gen.step(sink)
        assert_declared(sink.drain())


def test_a_wrong_field_does_not_fit():
    """The check itself fails where it should (so the tests above can fail)."""
    for bad in ({"kind": "alloc", "tier": "gpu", "seq": 3, "blocks": [1]},
                {"kind": "alloc", "tier": "gpu", "blocks": [1]},
                {"kind": "alloc", "tier": "gpu", "seq": "a", "blocks": [1], "extra": 1},
                {"kind": "teleport"}):
        try:
            assert_declared([bad])
        except AssertionError:
            continue
        raise AssertionError(f"{bad} passed")


def test_block_id_fields_are_the_fields_typed_as_block_ids():
    assert S.BLOCK_ID_FIELDS == ("blocks", "src", "dst")
    cow = msgspec.inspect.type_info(S.Cow)
    assert [f.name for f in cow.fields] == ["tier", "seq", "logical", "src", "dst", "group"]


def test_every_kind_has_a_type_and_a_meaning():
    assert len(S.EVENT_KINDS) == 23 and S.EVENT_KINDS[0] == S.TIER_INIT
    for kind, cls in S.EVENT_TYPES.items():
        assert cls.__struct_config__.tag == kind
        assert S.meaning(cls), kind


def test_python_m_engine_events_prints_the_table():
    out = subprocess.run([sys.executable, "-m", "kvscope.engine.events"], cwd=ROOT, text=True,
                         capture_output=True, timeout=60, check=True).stdout
    for kind, cls in S.EVENT_TYPES.items():
        assert f"{kind}  " in out and S.fields_text(cls) in out and S.meaning(cls) in out
    assert "seq_add      seq: str, prompt_tokens?: int, priority?: int, parent?: str | None" \
        in out
    assert "cow          tier: str, seq: str, logical: list[int], src: ids, dst: ids" in out
