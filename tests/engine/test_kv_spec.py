"""The KV layout is built once (engine.runner.kv_budget.build) as a frozen KVSpec and
handed whole to the cache manager, the runner and tensor parallelism."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvscope.engine.cache import CacheError, KVCacheManager
from kvscope.engine.cache.spec import KVSpec
from kvscope.engine.runner.kv_budget import spec_of


@pytest.mark.parametrize("kw", [{}, {"kv_cache_dtype": "int8", "swap_space": 0.01},
                                {"kv_demotion": "int8"}])
def test_the_engine_builds_one_spec_and_hands_it_whole(make_engine, kw):
    eng = make_engine(num_gpu_blocks=24, block_size=8, **kw)
    spec = eng.kv_spec
    assert eng.runner.spec is spec  # the runner's layout is the engine's, not rebuilt
    assert eng.page_format is spec.page and eng.mixed is spec.mixed
    assert spec.format == spec.page.name == eng.cache.gpu.kv_format
    assert (spec.num_blocks, spec.block_size) == (24, 8) == \
        (eng.runner.num_blocks, eng.cache.block_size)
    assert bool(eng.cache.host) == bool(spec.num_cpu_blocks) == bool(eng.runner.swapper)
    if spec.mixed is None:  # (a mixed arena's pool counts page codes over the frames)
        assert eng.cache.gpu.num_blocks == spec.num_blocks
        assert eng.runner.kv.format is spec.page
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_blocks = 1


def test_the_manager_takes_a_spec_or_the_sizes_not_both():
    spec = KVSpec(4, 8, num_cpu_blocks=2, format="int8")
    mgr = KVCacheManager(spec=spec)
    assert (mgr.gpu.num_blocks, mgr.block_size, mgr.pools["cpu"].num_blocks) == (8, 4, 2)
    assert mgr.gpu.kv_format == "int8"
    with pytest.raises(CacheError, match="not both"):
        KVCacheManager(8, 4, spec=spec)
    with pytest.raises(CacheError, match="not both"):
        KVCacheManager(spec=spec, kv_format="int4")


def test_a_tensor_parallel_rank_gets_its_shard_of_the_heads(loaded):
    from kvscope.engine.distributed.tp import shard_spec

    _, _, mc = loaded
    spec = spec_of("int8", torch.float32, mc, 16, 10)
    local = shard_spec(spec, mc, 3)
    assert local.page.num_kv_heads == mc.num_kv_heads // 3
    assert dataclasses.replace(local, page=spec.page) == spec  # only the heads differ


def test_the_spec_asserts_its_page_format_is_the_one_it_names(loaded):
    _, _, mc = loaded
    spec = spec_of("int4", torch.float32, mc, 16, 10)
    assert spec.format == "int4"
    with pytest.raises(AssertionError):
        spec.replace(format="int8")
    with pytest.raises(AssertionError):
        KVSpec(16, 10, format="int3")
