"""The inspector shows demotion: per-block format in the block map (demoted used/shared
blocks get their own codes and hues, the tooltip names the block's own format) and the
blocks demoted per step on the timeline."""

from __future__ import annotations

from kvscope.engine.events import KVState
from kvscope.engine.events import schema as S
from kvscope.inspector import palette as P
from kvscope.inspector.timeline import Timeline
from kvscope.inspector.views.block_map import cell_codes, describe_block


def _batches() -> list[dict]:
    ev = [
        {"kind": "tier_init", "tier": "gpu", "num_blocks": 8, "block_size": 4, "format": "fp32"},
        {"kind": "seq_add", "seq": "a", "prompt_tokens": 12},
        {"kind": "seq_start", "seq": "a"},
        {"kind": "alloc", "tier": "gpu", "seq": "a", "blocks": [0, 1, 2]},
        {"kind": "seq_add", "seq": "b", "prompt_tokens": 8, "parent": "a"},
        {"kind": "fork", "tier": "gpu", "seq": "b", "parent": "a", "blocks": [0, 1, 2]},
    ]
    return [{"v": 1, "step": 0, "events": ev},
            {"v": 1, "step": 1, "events": [
                {"kind": "quantize", "tier": "gpu", "blocks": [0, 1], "format": "int8"}]},
            {"v": 1, "step": 2, "events": [
                {"kind": "quantize", "tier": "gpu", "blocks": [0], "format": "int4"}]}]


def test_block_map_colours_and_describes_each_blocks_format():
    st = KVState()
    for b in _batches():
        st.apply(b)
    codes = cell_codes(st, "gpu")
    assert codes[:4].tolist() == [P.CODE_DEMOTED_SHARED, P.CODE_DEMOTED_SHARED,
                                  S.BLOCK_SHARED, S.BLOCK_FREE]
    assert [describe_block(st, "gpu", b)["format"] for b in (0, 1, 2)] == [
        "int4", "int8", "fp32"]
    assert describe_block(st, "gpu", 0)["state"] == "shared (demoted)"
    lut = P.block_lut("gpu", "fp32")
    assert tuple(lut[P.CODE_DEMOTED_USED]) == P.rgba(P.QUANT_USED)


def test_timeline_counts_blocks_demoted_per_step():
    tl = Timeline()
    tl.extend(_batches())
    assert tl.col("demotions").tolist() == [0, 2, 1]
