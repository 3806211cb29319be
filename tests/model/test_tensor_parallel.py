"""Tensor parallelism on CPU over gloo, for real (spawned ranks, collectives): greedy
output token for token equal to TP=1 on the embedded model (TP=3: its 3 KV heads) and on a
tiny random model (TP=2), a clear start-up error when the heads do not divide, and a dead
rank that fails the engine at once instead of hanging it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvscope.engine.config import EngineConfig
from kvscope.engine.engine import LLMEngine
from kvscope.engine.sampling_params import SamplingParams
from tests.model.tiny_models import save_hf, tiny_hf_model
from tests.waiting import HANG_S, wait_until


def _greedy(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0,
                                                      ignore_eos=True))
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[f"r{i}"] for i in range(len(prompts))]


def _run(config: EngineConfig, prompts: list[list[int]], n: int, loaded=None) -> list:  # noqa: ANN001
    engine = LLMEngine(config, loaded=loaded)
    try:
        return _greedy(engine, prompts, n)
    finally:
        engine.close()


@pytest.mark.slow
def test_tp3_matches_tp1_on_the_embedded_model(smollm2) -> None:  # noqa: ANN001
    tok = smollm2[1]
    shared = tok.encode("The capital of France is Paris. The capital of Italy is")
    prompts = [shared, shared + tok.encode(" Rome, and of Spain it is")]  # a prefix hit
    kw = dict(num_gpu_blocks=16, block_size=8, seed=0)
    ref = _run(EngineConfig(**kw), prompts, 6, smollm2)
    assert _run(EngineConfig(tensor_parallel_size=3, **kw), prompts, 6, smollm2) == ref


def test_tp2_is_refused_on_the_embedded_model(smollm2) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide .*"
                                         r"num_key_value_heads=3"):
        LLMEngine(EngineConfig(tensor_parallel_size=2, num_gpu_blocks=8), loaded=smollm2)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 query heads, 2 KV heads, vocab 272: TP=2 splits everything, the vocab evenly
    return save_hf(tiny_hf_model("llama", seed=1), tmp_path_factory.mktemp("tp") / "llama")


def test_tp2_matches_tp1_on_a_tiny_model(tiny_dir: Path) -> None:
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7, 8, 9, 10, 11, 12, 40],
               list(range(30, 70))]
    kw = dict(model=str(tiny_dir), num_gpu_blocks=48, block_size=4)
    ref = _run(EngineConfig(**kw), prompts, 10)
    engine = LLMEngine(EngineConfig(tensor_parallel_size=2, **kw))
    try:
        assert _greedy(engine, prompts, 10) == ref
        # prompt logprobs would need a vocab-parallel gather on every rank: refused at the
        # door, and the engine goes on serving
        with pytest.raises(ValueError, match="prompt_logprobs"):
            engine.add_request("lp", prompts[0], SamplingParams(prompt_logprobs=1))
        assert _greedy(engine, prompts[:1], 10) == ref[:1]
    finally:
        engine.close()


def test_a_dead_rank_fails_the_engine_loudly(tiny_dir: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from kvscope.engine.distributed.tp import TensorParallelError
    from kvscope.engine.server.engine_loop import EngineLoop

    engine = LLMEngine(EngineConfig(model=str(tiny_dir), tensor_parallel_size=2,
                                    num_gpu_blocks=16, block_size=4))
    try:
        assert _greedy(engine, [[1, 2, 3]], 2)  # it works ...
        engine.runner.procs[0].kill()  # ... until rank 1 dies
        engine.runner.procs[0].join(HANG_S)
        assert not engine.runner.procs[0].is_alive()
        engine.add_request("x", [4, 5, 6], SamplingParams(max_tokens=2))

        def no_collective(*args: object, **kwargs: object) -> None:
            raise AssertionError("a collective with a dead rank waits for its timeout")

        # An error, not a hang: the step fails before its first collective (the command
        # broadcast), the one thing that could wait for the dead rank.
        monkeypatch.setattr(dist, "broadcast_object_list", no_collective)
        with pytest.raises(TensorParallelError, match="rank 1 died"):
            engine.step()
        # in the daemon, the engine loop marks itself failed (/health answers 500) and
        # refuses new requests with the cause
        loop = EngineLoop(engine)
        loop.start()
        wait_until(lambda: loop.failed is not None, "the engine loop to fail")
        assert isinstance(loop.failed, TensorParallelError)
        fut = loop.submit("y", {"prompt_token_ids": [7, 8]}, SamplingParams(max_tokens=2),
                          lambda item: None)
        with pytest.raises(RuntimeError, match="engine failed: tensor-parallel rank 1 died"):
            fut.result(HANG_S)
        loop.stop()
    finally:
        engine.close()
