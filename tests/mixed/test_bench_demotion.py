"""`kvscope bench demotion`: each configuration gets the one KV budget and its own page
setting; the summary table prints every row (the runs themselves are the benchmark)."""

from __future__ import annotations

import argparse

from kvscope.engine.bench import demotion


def test_every_config_gets_the_same_budget_and_its_page_setting():
    args = argparse.Namespace(block_size=16, concurrency=4, seed=0,
                              demotion="int8,int4; int8,kivi4", hot_window=256)
    configs = demotion.configs(args.demotion)
    assert configs == ["full", "int8", "int4", "demotion=int8,int4", "demotion=int8,kivi4"]
    kws = {c: demotion.engine_config(c, args, 1 << 20) for c in configs}
    assert {kw["kv_cache_memory_bytes"] for kw in kws.values()} == {1 << 20}
    assert "kv_cache_dtype" not in kws["full"] and "kv_demotion" not in kws["full"]
    assert kws["int4"]["kv_cache_dtype"] == "int4"
    assert kws["demotion=int8,int4"]["kv_demotion"] == "int8,int4"
    assert kws["demotion=int8,kivi4"]["kv_demotion"] == "int8,kivi4"
    row = {"kv_blocks": 10, "kv_frames": None, "mean_running": 1.0, "peak_running": 2,
           "prefix_hit_rate": 0.5, "preemptions": 1, "evictions": 3, "demoted_blocks": 0,
           "gen_tok_per_s": 2.0, "greedy_same_as_full": 1.0}
    text = demotion.table({"doc_qa": {c: row for c in configs},
                           "accuracy": {"full": {"ppl_ratio": 1.0, "top1_agreement": 1.0}}})
    assert all(c in text for c in configs) and "accuracy full" in text
