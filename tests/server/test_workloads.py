"""Workload definitions: every named workload loads, is deterministic for a seed, and
produces what its name promises (shared prefixes, growing turns, long documents, bursts)."""

from __future__ import annotations

import json

import pytest

from kvscope.engine.loadgen.summary import percentile
from kvscope.engine.loadgen.workloads import (
    WorkloadError,
    list_workloads,
    load_workload,
    read_document,
    sessions,
)

NAMES = ["bursty", "demo", "doc_qa", "mixed", "multi_turn", "shared_system_chat"]


def test_named_workloads_exist() -> None:
    assert list_workloads() == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_seeded_and_deterministic(name: str) -> None:
    w = load_workload(name)
    a = sessions(w, seed=3, rate=2.0, duration=20)
    b = sessions(w, seed=3, rate=2.0, duration=20)
    c = sessions(w, seed=4, rate=2.0, duration=20)
    assert a == b and a != c and len(a) > 5
    assert all(0 <= s.start_s < 20 and s.turns and s.max_tokens >= 1 for s in a)
    assert [s.start_s for s in a] == sorted(s.start_s for s in a)


def test_shapes() -> None:
    shared = sessions(load_workload("shared_system_chat"), seed=0, rate=1, duration=30)
    assert len({s.system for s in shared}) == 1 and len(shared[0].system) > 500
    multi = sessions(load_workload("multi_turn"), seed=0, rate=1, duration=30)
    assert all(2 <= len(s.turns) <= 4 for s in multi)
    docs = sessions(load_workload("doc_qa"), seed=0, rate=1, duration=60)
    assert all(len(s.turns[0]) > 2500 for s in docs)
    assert len({s.turns[0][:2000] for s in docs}) <= 4 < len(docs)  # few docs, many asks
    mixed = sessions(load_workload("mixed"), seed=0, rate=2, duration=60)
    kinds = [s.tag for s in mixed]
    assert "long" in kinds and kinds.count("short") > kinds.count("long")
    bursty = sessions(load_workload("bursty"), seed=0, rate=1, duration=30)
    starts = [s.start_s for s in bursty]
    assert max(starts.count(t) for t in starts) == 6  # bursts of 6 simultaneous starts


def test_real_documents_and_overrides() -> None:
    gpl = read_document({"paths": ["/usr/share/common-licenses/GPL-3"], "chars": 200})
    assert len(gpl) == 200 and "GNU" in gpl
    fallback = read_document({"paths": ["/no/such/file"], "chars": 50})
    assert len(fallback) == 50  # falls back to a file of this repository
    short = sessions(load_workload("mixed"), seed=0, rate=2, duration=30, max_tokens=3,
                     max_sessions=4)
    assert len(short) == 4 and all(s.max_tokens == 3 for s in short)


def test_bad_workloads(tmp_path) -> None:
    with pytest.raises(WorkloadError, match="named ones"):
        load_workload("nope")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(WorkloadError):
        load_workload(str(bad))
    bad.write_text(json.dumps({"name": "x", "generator": "quantum"}))
    with pytest.raises(WorkloadError, match="generator"):
        load_workload(str(bad))
    with pytest.raises(WorkloadError, match="rate"):
        sessions(load_workload("bursty"), seed=0, rate=0, duration=5)


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(list(range(1, 101)), 99) == 99
