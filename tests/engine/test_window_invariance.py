"""The invariance suite on a windowed model: a tiny random Gemma 3 (five sliding-window
layers of W = 8 per global one) whose greedy tokens, far past the window, are the contiguous
reference's (itself transformers' generate: tests/model/test_architectures.py) under every
cache configuration that must not change them: block sizes, preemption, chunked prefill,
prefix caching, copy-on-write forks, the contiguous layout, swap preemption."""

from __future__ import annotations

import pytest
import torch

from kvscope.engine.config import EngineConfig
from kvscope.engine.engine import LLMEngine
from kvscope.engine.model.loader import load_model
from kvscope.engine.reference_generate import generate_reference
from kvscope.engine.sampling_params import SamplingParams
from tests.engine.conftest import run_all
from tests.model.tiny_models import save_hf, tiny_hf_model

WINDOW = 8
SHARED = [(5 * i + 7) % 272 for i in range(24)]  # a prefix three windows long
PROMPTS = [SHARED + [(3 * i + t) % 272 for i in range(5 + 4 * t)] for t in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    hf = tiny_hf_model("gemma3_text", seed=21, sliding_window=WINDOW)
    path = save_hf(hf, tmp_path_factory.mktemp("gemma3-w8"))
    return load_model(path)


@pytest.fixture(scope="module")
def reference(loaded):
    model, tok, _ = loaded
    return [generate_reference(model, tok, p, GREEDY).token_ids for p in PROMPTS]


@pytest.fixture
def make_engine(loaded):
    engines: list[LLMEngine] = []

    def make(**kwargs) -> LLMEngine:
        kwargs = {"device": "cpu", "dtype": torch.float32, "model": "tiny-gemma3", **kwargs}
        eng = LLMEngine(EngineConfig(**kwargs), loaded=loaded)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.close()


def generate(engine, prompts, params=GREEDY):
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    out = run_all(engine)
    return [out[str(i)] for i in range(len(prompts))]


def test_the_model_is_windowed(loaded):
    assert loaded[2].layer_windows.count(WINDOW) == 6 and loaded[2].layer_windows[5] is None
    assert all(len(p) > 3 * WINDOW for p in PROMPTS)


@pytest.mark.parametrize("engine_args", [
    {"block_size": 1, "num_gpu_blocks": 512},
    {"block_size": 4, "num_gpu_blocks": 128},
    {"block_size": 16, "num_gpu_blocks": 32, "disable_hybrid_kv_cache_manager": True},
    {"block_size": 4, "num_gpu_blocks": 128, "max_num_batched_tokens": 7},  # chunked
    {"kv_layout": "contiguous", "max_model_len": 64, "num_gpu_blocks": 64},
], ids=["bs1", "bs4", "bs16-keep-all", "chunked7", "contiguous"])
def test_configurations_keep_the_reference_tokens(make_engine, reference, engine_args):
    outs = generate(make_engine(**engine_args), PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_preemption_keeps_the_reference_tokens(make_engine, reference):
    # 24 blocks of 4 hold two of the four sequences at most: the growing ones preempt
    eng = make_engine(block_size=4, num_gpu_blocks=24, watermark=0.0)
    outs = generate(eng, PROMPTS)
    assert eng.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_swap_preemption_with_the_hybrid_cache_keeps_the_reference_and_the_mirror(
        make_engine, reference, tmp_path):
    """A cpu tier beside the hybrid cache: preempted sequences swap out both groups (the
    full-attention table and the window group's held blocks, each to its own host pool)
    and back; the greedy tokens are the unpreempted reference's, and the state rebuilt
    from the recording equals the engine's kv_state() after every step."""
    from kvscope.engine.events import KVState
    from kvscope.engine.events.wire.recording import Recording

    path = tmp_path / "hybrid-swap.kvtrace"
    eng = make_engine(block_size=4, num_gpu_blocks=24, watermark=0.0, swap_space=0.01,
                      preemption_mode="swap", record_path=str(path))
    assert eng.cache.window is not None and eng.cache.window_host is not None
    expected, done, steps = {eng.step_count: eng.kv_state()}, {}, 0
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
        expected[eng.step_count] = eng.kv_state()
        eng.cache.check_invariants()
        steps += 1
        assert steps < 1000  # hang guard
    assert [done[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == reference
    wh, win = eng.cache.window_host, eng.swapper.window
    assert eng.cache.num_swap_fallbacks == 0 and wh.num_swap_outs == wh.num_swap_ins > 0
    assert win.blocks_out > 0 and win.blocks_in > 0  # the windowed layers' pages moved
    eng.close()
    state, kinds = KVState(), set()
    for batch in Recording(path):
        state.apply(batch)
        kinds |= {(e["kind"], e.get("group", 0)) for e in batch["events"]}
        if batch["step"] in expected:
            assert state.canonical() == expected[batch["step"]], f"step {batch['step']}"
    assert {("swap_out", 1), ("swap_in", 1), ("swap_out", 0)} <= kinds and "cpu/1" in state.tiers


def test_each_group_swaps_its_own_pages_and_scale_pages(loaded):
    """The runner's swap of a hybrid cache with int8 pages (per-token scales; both groups
    take the per-token formats): group 0's rounds move the full-attention layers' K, V and
    scale pages, the window group's rounds the windowed layers', each through its own host
    pool, out and back into other blocks, bit for bit."""
    from kvscope.engine.runner.kv_budget import spec_of
    from kvscope.engine.runner.model_runner import ModelRunner
    from kvscope.engine.scheduler import SchedulerOutput

    model, _, mc = loaded
    window = max(w for w in mc.layer_windows if w is not None)
    spec = spec_of("int8", torch.float32, mc, 4, 8, num_cpu_blocks=4, window=window,
                   num_window_blocks=6, num_window_cpu_blocks=3)
    runner = ModelRunner(model, mc, spec, torch.device("cpu"))
    kv, groups = runner.kv, runner.group
    layers = [kv.k_caches, kv.v_caches, kv.k_scales, kv.v_scales]
    torch.manual_seed(0)
    for ts in layers:
        for t in ts:
            t.copy_(torch.randint(-100, 100, t.shape).to(t.dtype))
    src = {0: 5, 1: 2}  # a block of each group's pool
    before = [[t[src[groups[i]]].clone() for i, t in enumerate(ts)] for ts in layers]
    runner.run(SchedulerOutput(swap_rounds=[([(5, 1)], [])],
                               window_swap_rounds=[([(2, 0)], [])]))
    for ts in layers:
        for t in ts:
            t.zero_()
    runner.run(SchedulerOutput(swap_rounds=[([], [(1, 7)])],
                               window_swap_rounds=[([], [(0, 4)])]))
    dst = {0: 7, 1: 4}
    assert set(groups) == {0, 1} and kv.k_scales is not None
    for ts, old in zip(layers, before, strict=True):
        for i, t in enumerate(ts):
            assert torch.equal(t[dst[groups[i]]], old[i]), i
    assert runner.swapper.blocks_in == runner.swapper.window.blocks_in == 1


def test_prefix_caching_hits_keep_the_reference_tokens(make_engine, reference):
    """Prefix caching (on by default) with the hybrid cache: later prompts hit the shared
    prefix, three windows long, so each hit takes the window group's blocks of its last W
    tokens; the tokens are the reference's and the window group stays bounded."""
    eng = make_engine(block_size=4, num_gpu_blocks=128, enable_prefix_caching=True)
    assert eng.cache.window is not None
    bound, outs = WINDOW // 4 + 1, []
    for i, p in enumerate(PROMPTS):  # one at a time: later prompts hit the shared prefix
        eng.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
        done = {}
        while eng.has_unfinished_requests():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
            eng.cache.check_invariants()
            for s in eng.cache.sequences.values():
                if s.num_tokens > s.num_prompt_tokens:
                    assert eng.cache.window.held(s) <= bound
        outs.append(done[str(i)])
    assert all(o.metrics.num_cached_tokens >= 20 > 2 * WINDOW for o in outs[1:])
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_forks_keep_the_reference_tokens(make_engine, reference):
    eng = make_engine(block_size=4, num_gpu_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=2)
    outs = generate(eng, PROMPTS[:2], params)
    for out, ref in zip(outs, reference[:2], strict=True):
        assert out.outputs[0].token_ids == out.outputs[1].token_ids == ref
    assert eng.cache.metrics()["cow_copies"] > 0


# The hybrid cache (engine.cache.window_group): the five windowed layers in six read their
# own group's tables, whose blocks are released once out of the window. It is on in every
# test above but bs16-keep-all (prefix caching is on by default); these
# run it without prefix caching, its releases then freeing blocks outright.
HYBRID = {"enable_prefix_caching": False}


@pytest.mark.parametrize("engine_args", [
    {"block_size": 4, "num_gpu_blocks": 128},
    {"block_size": 16, "num_gpu_blocks": 32},
    {"block_size": 4, "num_gpu_blocks": 128, "max_num_batched_tokens": 7},  # chunked
], ids=["bs4", "bs16", "chunked7"])
def test_hybrid_cache_keeps_the_reference_tokens(make_engine, reference, engine_args):
    eng = make_engine(**engine_args, **HYBRID)
    assert eng.cache.window is not None and eng.runner.num_window_blocks > 0
    outs = generate(eng, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_hybrid_cache_switched_off_keeps_every_block(make_engine):
    eng = make_engine(block_size=4, num_gpu_blocks=64, disable_hybrid_kv_cache_manager=True,
                      **HYBRID)
    assert eng.cache.window is None


def test_hybrid_cache_preemption_and_forks_keep_the_reference_tokens(make_engine, reference):
    # 24 full-attention blocks of 4 hold two of the four sequences at most: preemptions
    eng = make_engine(block_size=4, num_gpu_blocks=24, watermark=0.0, **HYBRID)
    outs = generate(eng, PROMPTS)
    assert eng.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    eng = make_engine(block_size=4, num_gpu_blocks=128, **HYBRID)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=2)
    outs = generate(eng, PROMPTS[:2], params)
    for out, ref in zip(outs, reference[:2], strict=True):
        assert out.outputs[0].token_ids == out.outputs[1].token_ids == ref


def test_hybrid_cache_long_generation_keeps_the_window_group_bounded(make_engine):
    """64 decode steps, 8 windows: every step, each running sequence holds at most
    W / block_size + 1 window blocks while its full-attention table keeps growing."""
    eng = make_engine(block_size=4, num_gpu_blocks=128, **HYBRID)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    for i, p in enumerate(PROMPTS[:2]):
        eng.add_request(str(i), {"prompt_token_ids": p}, params)
    bound, longest, steps = WINDOW // 4 + 1, 0, 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
        for s in eng.cache.sequences.values():
            if s.num_tokens > s.num_prompt_tokens:  # decoding (a prefill holds its chunk)
                assert eng.cache.window.held(s) <= bound
            longest = max(longest, len(s.block_table))
        assert steps < 1000  # hang guard
    assert longest * 4 >= len(PROMPTS[1]) + 63
    assert eng.cache.window.pool.num_free_blocks == eng.cache.window.pool.num_blocks


def test_hybrid_cache_recording_equals_kv_state_every_step(make_engine, tmp_path):
    """The events name each block's group: the state rebuilt from a recording (through
    the wire codec) equals the engine's kv_state() after every step, window group's pool
    and tables included, through preemptions and forks."""
    from kvscope.engine.events import KVState
    from kvscope.engine.events.wire.recording import Recording

    path = tmp_path / "hybrid.kvtrace"  # prefix caching on: group-1 stores, hits, evicts
    eng = make_engine(block_size=4, num_gpu_blocks=12, watermark=0.0, record_path=str(path))
    expected = {eng.step_count: eng.kv_state()}
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), {"prompt_token_ids": p},
                        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                       n=2 if i == 0 else 1))
    while eng.has_unfinished_requests():
        eng.step()
        expected[eng.step_count] = eng.kv_state()
    assert eng.scheduler.num_preemptions > 0
    assert any(s.get("group_tables") for snap in expected.values()
               for s in snap["seqs"].values())
    eng.close()
    expected[eng.step_count] = eng.kv_state()
    state, kinds = KVState(), set()
    for batch in Recording(path):
        state.apply(batch)
        kinds |= {(e["kind"], e.get("group", 0)) for e in batch["events"]}
        if batch["step"] in expected:
            assert state.canonical() == expected[batch["step"]], f"step {batch['step']}"
    assert {("release", 1), ("hit", 1), ("store", 1)} <= kinds and "gpu/1" in state.tiers


def test_hybrid_cache_from_a_byte_budget_fits_it_and_keeps_the_reference(make_engine,
                                                                          reference):
    """No block count given: the byte budget is split between the two pools (one prefill
    chunk for the window pool first); their pages fit it, and the tokens are unchanged."""
    budget = 1 << 20
    eng = make_engine(block_size=4, kv_cache_memory_bytes=budget, max_model_len=64,
                      max_num_seqs=4, **HYBRID)
    assert eng.cache.window is not None
    pages = sum(t.numel() * t.element_size() for t in (*eng.runner.k_caches,
                                                      *eng.runner.v_caches))
    assert pages <= budget
    assert eng.cache.window.pool.num_blocks < eng.cache.gpu.num_blocks
    outs = generate(eng, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == reference
