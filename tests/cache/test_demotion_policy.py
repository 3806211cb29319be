"""Which blocks the demotion planner picks: cached prefixes first, then the coldest blocks
of running sequences, never a block within a sequence's hot window or a partial block;
nothing at all above the watermark; bad policies are clear errors."""

from __future__ import annotations

import pytest

from kvscope.engine.cache import CacheError
from kvscope.engine.cache.demotion import DemotionPolicy
from tests.cache.conftest import Mirrored


def _mirrored(frames: int, hot_window: int, formats=("int8",), low=0.5, high=0.6):
    policy = DemotionPolicy(formats, {"int8": 2, "int4": 4}
                            if len(formats) == 2 else {formats[0]: 2}, hot_window,
                            low=low, high=high)
    return Mirrored(frames, 4, demotion=policy)


def test_cached_prefixes_go_first_then_cold_blocks_never_the_hot_window():
    x = _mirrored(frames=12, hot_window=8)
    m = x.m
    m.add_sequence("done", list(range(8)))  # 2 full blocks, then finished: cached
    m.allocate_slots("done", 8)
    m.start("done")
    m.finish("done", "stop")
    m.add_sequence("run", list(range(100, 122)))  # 22 tokens: 5 full blocks + partial
    m.allocate_slots("run", 22)
    m.start("run")
    x.sync()
    table = m.block_table("run")
    assert m.demote_cold_blocks() > 0
    x.sync()
    fmt = m.gpu.fmt
    cached = [b for b in range(m.gpu.num_blocks) if m.gpu.entry[b] and m.gpu.ref[b] == 0]
    assert cached and all(fmt[b] == "int8" for b in cached)
    # hot window 8 tokens: blocks ending within the last 8 tokens (blocks 3, 4) and the
    # partial block 5 stay full precision; the demoted ones are the oldest
    assert [fmt[b] for b in table[3:]] == [m.gpu.kv_format] * 3
    demoted = [i for i, b in enumerate(table) if fmt[b] != m.gpu.kv_format]
    assert demoted == list(range(len(demoted)))
    assert x.state.canonical()["tiers"]["gpu"]["block_formats"] == {
        b: "int8" for b in range(m.gpu.num_blocks) if fmt[b] == "int8"}


def test_nothing_is_demoted_above_the_watermark():
    x = _mirrored(frames=40, hot_window=0, low=0.1, high=0.2)
    x.m.add_sequence("a", list(range(40)))
    x.m.allocate_slots("a", 40)
    x.m.start("a")
    assert x.m.demote_cold_blocks() == 0  # 30 of 40 frames free
    assert x.m.demote_cold_blocks(reserve=35) > 0  # the next admission needs 35
    assert len(x.m.gpu.free_frames) >= 35
    x.sync()


@pytest.mark.parametrize("formats, subs, hot, match", [
    (("int4", "int8"), {"int8": 2, "int4": 4}, 8, "fewer bits"),
    (("fp8",), {"fp8": 2}, 8, "one or two of int8, k8v4"),
    (("kivi4", "int4"), {"kivi4": 8, "int4": 8}, 8, "fewer bits"),
    (("k8v4", "kivi2"), {"k8v4": 4, "kivi2": 16}, 8, "at most one of kivi4"),
    (("int8",), {"int8": 2}, -1, "hot window"),
])
def test_bad_policies_are_clear_errors(formats, subs, hot, match):
    with pytest.raises(CacheError, match=match):
        DemotionPolicy(formats, subs, hot)


def test_demotion_and_a_cpu_tier_are_refused():
    with pytest.raises(CacheError, match="cpu tier"):
        Mirrored(8, 4, num_cpu_blocks=4, demotion=DemotionPolicy(("int8",), {"int8": 2}))
