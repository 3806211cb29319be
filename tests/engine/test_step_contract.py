"""The step's contract: the scheduler's output carries everything the runner needs.

After ``schedule`` returns, each scheduled sequence's slot mapping (what
``allocate_slots`` returned) is exactly the slots of its positions read off its block
table, and the table is the cache's (page codes over a mixed arena); every order the
cache queued has been taken into the output. And the engine itself calls the cache
manager nowhere inside a step: it all goes through the scheduler."""

from __future__ import annotations

import pytest

from kvscope.engine.sampling_params import SamplingParams
from tests.engine.conftest import PROMPTS, as_prompt
from tests.swap.test_swap_engine import swap_gib

FORKED = SamplingParams(temperature=0.8, seed=3, max_tokens=12, n=2, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

CONFIGS = {
    # tiny pool: recompute preemption, prefix sharing, copy-on-write forks
    "paged": dict(block_size=4, num_gpu_blocks=24, watermark=0.0),
    "contiguous": dict(block_size=4, num_gpu_blocks=80, kv_layout="contiguous",
                       max_model_len=32, enable_prefix_caching=False),
    "mixed": dict(block_size=4, num_gpu_blocks=16, watermark=0.0, kv_demotion="int8,int4",
                  kv_hot_window=4),
    "swap": dict(block_size=4, num_gpu_blocks=24, watermark=0.0, preemption_mode="swap"),
}


class _NoCacheCalls:
    """Stands in for ``LLMEngine.cache`` during a step: any use of it fails the test."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the engine called cache.{name} inside a step")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_output_carries_tables_slots_and_every_order(make_engine, loaded, name):
    kw = dict(CONFIGS[name])
    if name == "swap":
        kw["swap_space"] = swap_gib(64, 4, loaded)
    eng = make_engine(**kw)
    cache, bs = eng.cache, eng.config.block_size
    codes = cache.page_codes if name == "mixed" else None
    schedule = eng.scheduler.schedule
    seen = {"steps": 0, "tokens": 0}

    def checked():
        out = schedule()
        for s in out.scheduled:
            table = cache.block_table(s.seq.seq_id)
            if codes is not None:
                table = codes(table)
            assert s.block_table == table
            assert s.start == s.seq.num_computed_tokens
            assert s.slot_mapping == [table[p // bs] * bs + p % bs
                                      for p in range(s.start, s.start + s.num_new_tokens)]
            seen["tokens"] += s.num_new_tokens
        assert cache.take_copy_orders() == [] and cache.take_swap_rounds() == []
        assert cache.take_demotion_orders() == []
        seen["steps"] += 1
        return out

    eng.scheduler.schedule = checked
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", as_prompt(loaded, p), FORKED if i % 2 else LONG)
    while eng.has_unfinished_requests():
        eng.cache = _NoCacheCalls()
        try:
            eng.step()
        finally:
            eng.cache = cache
        cache.check_invariants()
    assert seen["steps"] > 0 and seen["tokens"] > 0
    if name == "paged":
        assert eng.scheduler.num_preemptions > 0 and cache.metrics()["cow_copies"] > 0
    if name == "swap":
        assert cache.metrics()["swap_outs"] > 0
    if name == "mixed":
        assert eng.stats.demoted_blocks > 0
