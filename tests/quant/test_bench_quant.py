"""`kvscope bench quant` pieces on a tiny text: the metrics mean what they claim."""

from __future__ import annotations

import math

from kvscope.engine.bench.quant import capacity_table, teacher_forced


def test_teacher_forced_metrics_on_a_short_text(loaded):
    model, tok, cfg = loaded
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 6)[:48]
    scores = teacher_forced(model, cfg, ids, ["auto", "int8", "bf16"], chunk=16, block_size=16)
    auto = scores["auto"]
    assert auto["ppl_ratio"] == 1.0 and auto["kl_mean"] == 0.0 and auto["top1_agreement"] == 1.0
    assert 1.0 < auto["ppl"] < 100.0  # a repeated sentence is easy, not free
    for d in ("int8", "bf16"):
        assert 0.0 < scores[d]["kl_mean"] < 0.05  # lossy, but close
        assert math.isclose(scores[d]["ppl"] / auto["ppl"], scores[d]["ppl_ratio"], rel_tol=1e-3)
        assert 0.9 <= scores[d]["top1_agreement"] <= 1.0


def test_capacity_table_compares_against_16_bit_pages(loaded):
    cfg = loaded[2]
    table = capacity_table(["auto", "fp8", "int8", "int4"], cfg, 16, 64 << 20)
    assert table["auto"]["capacity_ratio"] == 1.0 and table["auto"]["auto_fp32_ratio"] == 0.5
    assert table["fp8"]["capacity_ratio"] == 2.0
    assert table["int8"]["capacity_ratio"] >= 1.9 and table["int4"]["capacity_ratio"] >= 3.5
    assert table["int4"]["capacity_tokens"] == table["int4"]["blocks"] * 16
