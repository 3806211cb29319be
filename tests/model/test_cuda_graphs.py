"""kvscope.engine.runner.cuda_graphs: pure decode steps run from per-bucket captured forwards over
static buffers, padded rows never touch the cache, and everything else runs eagerly.

On CPU the capture seam gets ``ReplayByCalling``, a double with a CUDA graph's contract (the
output tensor is fixed at capture; a replay recomputes it from whatever the buffers hold),
so the buffers, padding, buckets and fallbacks run here with the real model and paged
attention. The ``gpu`` tests capture real CUDA graphs (scripts/gpu_check.py runs them)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch

from kvscope.engine import LLM, SamplingParams
from kvscope.engine.runner import cuda_graphs
from kvscope.engine.runner.cuda_graphs import GRAPH_BUCKETS, DecodeGraphs

# Five sequences that stop one after another: decode batches of 5, 4, 3, 2, 1 sequences run
# in buckets 8, 4, 4, 2, 1.
PROMPTS = [[5, 17, 99, 3, 250, 7], [11, 12], [300, 301, 302, 303, 304, 305, 306, 307, 308, 42],
           [9] * 21, [44, 45, 46]]
MAX_TOKENS = [6, 9, 12, 15, 18]


class ReplayByCalling:
    """A Graph whose replay runs the captured forward again into the captured output."""

    captures: list[int] = []

    def __init__(self, pool) -> None:
        self.forward: Callable[[], torch.Tensor] | None = None
        self.out: torch.Tensor | None = None

    def capture(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.forward, self.out = forward, forward()
        ReplayByCalling.captures.append(self.out.shape[0])
        return self.out

    def replay(self) -> None:
        self.out.copy_(self.forward())


def _greedy(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                         for m in MAX_TOKENS])
    return [list(o.outputs[0].token_ids) for o in outs]


def _tiny(**kw) -> LLM:
    # block size 4: every sequence spans several pages, and block 0 (the padding rows'
    # page) belongs to a real sequence whose tokens would change if padding wrote into it
    return LLM("dummy:tiny", device="cpu", dtype="float32", seed=3, num_gpu_blocks=64,
               block_size=4, max_model_len=64, **kw)


def _with_graphs(llm: LLM) -> DecodeGraphs:
    engine = llm.llm_engine
    engine.runner.graphs = engine.runner.decode_graphs(engine.max_model_len,
                                                       engine.config.max_num_seqs,
                                                       new_graph=ReplayByCalling)
    return engine.runner.graphs


@pytest.fixture(scope="module")
def eager_tokens() -> list[list[int]]:
    llm = _tiny()
    assert llm.llm_engine.runner.graphs is None  # CPU: never real graphs
    return _greedy(llm)


def test_graph_decode_gives_the_eager_tokens(eager_tokens):
    llm = _tiny()
    graphs = _with_graphs(llm)
    ReplayByCalling.captures = []
    assert _greedy(llm) == eager_tokens
    # one capture per bucket, on its first step; every later step of it a replay
    assert ReplayByCalling.captures == [8, 4, 2, 1]
    assert sorted(graphs.graphs) == [1, 2, 4, 8]
    assert graphs.replays == max(MAX_TOKENS) - 1  # every decode step, none of the prefill


def test_graph_decode_leaves_the_cache_as_eager_does(eager_tokens):
    """The KV pages after a run are the eager run's: padding rows wrote nothing."""
    eager, graphed = _tiny(), _tiny()
    _with_graphs(graphed)
    _greedy(eager), _greedy(graphed)
    for a, b in zip(eager.llm_engine.runner.k_caches + eager.llm_engine.runner.v_caches,
                    graphed.llm_engine.runner.k_caches + graphed.llm_engine.runner.v_caches,
                    strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_steps_that_do_not_fit_run_eagerly():
    llm = _tiny()
    graphs = _with_graphs(llm)
    runner = llm.llm_engine.runner

    def batch(n: int, width: int, tokens: int | None = None):
        from kvscope.engine.runner.model_runner import StepBatch

        t = n if tokens is None else tokens
        return StepBatch(input_ids=torch.zeros(t, dtype=torch.int64),
                         positions=torch.zeros(t, dtype=torch.int64),
                         slot_mapping=torch.full((t,), -1, dtype=torch.int64),
                         block_tables=torch.zeros(n, width, dtype=torch.int32),
                         seq_lens=torch.ones(n, dtype=torch.int32),
                         cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32),
                         sample_index=torch.arange(n))

    assert graphs.max_blocks_per_seq == 16  # max_model_len 64 / block size 4
    assert graphs.run(batch(2, 17)) is None  # a table wider than max_model_len allows
    assert graphs.run(batch(2, 4, tokens=5)) is None  # a prompt chunk in the step
    assert graphs.run(batch(graphs.buckets[-1] + 1, 4)) is None  # above the largest bucket
    runner.attn.calibrate[0] = True  # fp8 scales not calibrated yet
    assert graphs.run(batch(2, 4)) is None
    runner.attn.calibrate[0] = False
    with torch.inference_mode():  # as ModelRunner.execute runs it
        assert graphs.run(batch(2, 4)).shape == (2, llm.llm_engine.model_config.hidden_size)
    assert graphs.replays == 1


def test_a_failed_capture_decodes_eagerly(eager_tokens, monkeypatch, caplog):
    def refuse(self, forward):
        forward()  # a warm-up ran (it writes what the eager step writes), then capture fails
        raise RuntimeError("operation not permitted when stream is capturing")

    llm = _tiny()
    graphs = _with_graphs(llm)
    monkeypatch.setattr(ReplayByCalling, "capture", refuse)
    with caplog.at_level(logging.WARNING, logger=cuda_graphs.__name__):
        assert _greedy(llm) == eager_tokens
    assert not graphs.enabled and graphs.graphs == {} and graphs.replays == 0
    assert caplog.text.count("decoding eagerly") == 1
    assert "stream is capturing" in caplog.text


@pytest.mark.parametrize(("max_num_seqs", "largest"), [(3, 4), (256, 256), (100, 104),
                                                       (4096, 512)])
def test_buckets_cover_max_num_seqs(max_num_seqs, largest):
    graphs = DecodeGraphs(None, None, None, max_num_seqs=max_num_seqs, max_blocks_per_seq=4,
                          device=torch.device("cpu"))
    assert graphs.buckets[-1] == largest
    assert set(graphs.buckets) <= set(GRAPH_BUCKETS)
    assert graphs.bucket_for(1) == 1 and graphs.bucket_for(3) == 4
    assert graphs.bucket_for(largest) == largest and graphs.bucket_for(largest + 1) is None
    if max_num_seqs >= 9:
        assert graphs.bucket_for(9) == 16


def test_cpu_never_builds_cuda_graphs():
    """Only CUDA captures: on CPU enforce_eager=False means the compiled forward instead."""
    assert _tiny(enforce_eager=False).llm_engine.runner.graphs is None  # CPU: compile instead
    assert _tiny().llm_engine.runner.graphs is None  # the default: eager on CPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_give_the_eager_tokens(dtype):
    """Real CUDA graphs on the device: the same greedy tokens as the eager GPU engine."""
    def run(enforce_eager: bool | None) -> tuple[list[list[int]], LLM]:
        llm = LLM("dummy:smollm2-135m", device="cuda", dtype=dtype, seed=0,
                  num_gpu_blocks=512, enforce_eager=enforce_eager)
        return _greedy(llm), llm

    eager, _ = run(True)
    graphed, llm = run(None)  # the default on CUDA
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    assert graphs.replays == max(MAX_TOKENS) - 1
    assert graphed == eager
