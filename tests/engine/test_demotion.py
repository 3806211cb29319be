"""Engine with --kv-demotion: the event mirror equals kv_state() at every step while cold
pages are demoted to int8 and kivi4 under memory pressure (through prefix sharing,
copy-on-write forks and preemption), and with no memory pressure greedy outputs are
exactly those of a full-precision engine."""

from __future__ import annotations

import pytest

from kvscope.engine.events import KVState
from kvscope.engine.events.wire.recording import Recording
from tests.engine.conftest import GREEDY, PROMPTS, run_all
from tests.engine.test_events_fidelity import workload


def test_mirror_equals_kv_state_every_step_while_demoting(make_engine, tmp_path):
    """The chain ends in a block-quantized format (kivi4: per-channel keys over each demoted
    block, in id-1 sub-pages of the arena; int4 pages go through the same planner and
    events, and the runner's int4 path is the pressure test's): the events and their
    meaning are those of int8,int4."""
    chain = "int8,kivi4"
    path = tmp_path / "run.kvtrace"
    # 10 frames of 4 tokens, hot window 4 tokens: most full blocks are cold at once.
    eng = make_engine(block_size=4, num_gpu_blocks=10, watermark=0.0, kv_demotion=chain,
                      kv_hot_window=4, record_path=str(path))
    expected = {eng.step_count: eng.kv_state()}
    workload(eng)
    formats_seen = set()
    while eng.has_unfinished_requests():
        eng.step()
        eng.cache.check_invariants()
        state = eng.kv_state()
        expected[eng.step_count] = state
        formats_seen |= set(state["tiers"]["gpu"]["block_formats"].values())
    assert formats_seen == set(chain.split(","))
    assert eng.stats.demoted_blocks > 0
    eng.close()
    expected[eng.step_count] = eng.kv_state()
    state = KVState()
    quantize_events = 0
    for batch in Recording(path):
        state.apply(batch)
        quantize_events += sum(e["kind"] == "quantize" for e in batch["events"])
        if batch["step"] in expected:
            assert state.canonical() == expected[batch["step"]], f"step {batch['step']}"
    assert quantize_events > 0


def test_greedy_outputs_without_memory_pressure_are_unchanged(make_engine, reference):
    # An arena laid out for a block-quantized target (its wider K scale columns) that never
    # demotes computes exactly what a full-precision pool computes.
    eng = make_engine(kv_demotion="int8,kivi4", kv_hot_window=256,
                      kv_cache_memory_bytes=64 << 20)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, GREEDY)
    done = run_all(eng)
    assert eng.stats.demoted_blocks == 0
    for i, p in enumerate(PROMPTS):
        assert done[f"r{i}"].outputs[0].token_ids == reference[p], p


def test_demotion_under_pressure_still_generates(make_engine):
    """Tiny pool, hot window of one block: prompts' early blocks are demoted while the
    requests decode; every request finishes with its full length."""
    eng = make_engine(block_size=4, num_gpu_blocks=12, kv_demotion="int4", kv_hot_window=4,
                      max_num_seqs=2)
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, GREEDY)
    done = run_all(eng)
    assert eng.stats.demoted_blocks > 0
    assert all(len(done[f"r{i}"].outputs[0].token_ids) == GREEDY.max_tokens
               for i in range(len(PROMPTS)))


@pytest.mark.parametrize("kwargs, match", [
    ({"kv_demotion": "int2"}, "one or two of int8, k8v4, int4, kivi4, kivi2"),
    ({"kv_demotion": "kivi2,kivi4"}, "fewer bits"),
    ({"kv_demotion": "int8", "kv_cache_dtype": "int8"}, "kv_cache_dtype='auto'"),
    ({"kv_demotion": "int8", "swap_space": 1.0}, "no swap space"),
    ({"kv_hot_window": -1}, "kv_hot_window"),
])
def test_bad_demotion_settings_are_clear_errors(kwargs, match):
    from kvscope.engine.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)
