"""The sections of scripts/gpu_check.py: what each one checks or measures on the GPU (and,
with ``smoke``, at tiny shapes on CPU), as a function of a ``Context`` returning one
JSON-able dict.

Every section runs in its own process (gpu_check.py starts one per section and kills it at
its budget), so a CUDA error, a leak or a hang in one never reaches the next. A section
returns ``status`` only to say ``fail`` (a correctness check failed) or ``timeout``;
``goal_met: False`` makes the driver write ``miss``; an exception makes it ``error``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import io
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
BIG = "dummy:llama-3-8b"  # the performance model
SMALL = "dummy:smollm2-135m"  # the correctness model
TINY = "dummy:tiny"  # both, in --smoke

# kernels: a representative subset of tests/kernels on the Triton path. The 8B-head-shape
# grid at block sizes 1 (Triton compiles ints == 1 as their own specialisation), 16 and 128
# (divisible by 16: one specialisation, different page/tile overlap), every page format,
# split-K decode over long contexts and prefill with cached context; then the tiny-shape
# files for what the grid lacks: split counts past the tiles, strided q out of a fused qkv,
# chunked prefill, quantized cache writes and copy-on-write, the mixed-precision arena.
# The gpu-marked grid skips on CPU (--smoke), where the rest runs under the interpreter.
KERNEL_TESTS = (
    *(f"tests/kernels/test_gpu_shapes.py::test_paged_attention_at_8b_head_shapes"
      f"[{bs}-{fmt}-{mode}]"
      for bs in (1, 16, 128) for fmt in ("auto", "fp8", "int8", "int4")
      for mode in ("decode", "prefill")),
    "tests/kernels/test_triton_attention.py::"
    "test_decode_split_counts_including_more_splits_than_tiles",
    "tests/kernels/test_triton_attention.py::test_decode_explicit_max_seq_len_and_bf16_pages",
    "tests/kernels/test_triton_attention.py::test_prefill_with_cached_context",
    "tests/kernels/test_triton_attention.py::test_strided_query_and_preallocated_out",
    "tests/kernels/test_triton_attention.py::test_chunked_prefill_equals_full_prefill",
    # sliding windows: split-K decode whose early splits fall wholly before the window, and
    # prefills (fresh and after cached context) whose first key tiles are skipped
    "tests/kernels/test_window.py::test_triton_decode_window_matches_the_reference[3-20]",
    "tests/kernels/test_window.py::test_triton_prefill_window_matches_the_reference[33]",
    "tests/kernels/test_triton_quant.py",
    "tests/kernels/test_triton_cache.py",
    "tests/kernels/test_triton_mixed.py",
    "tests/kernels/test_triton_block_attention.py::"
    "test_decode_equals_the_torch_reference[kivi4]",
    "tests/kernels/test_triton_block_attention.py::"
    "test_prefill_with_cached_context_equals_the_torch_reference[kivi2]",
)
# invariance: greedy tokens of the paged engine equal plain contiguous generation across
# block sizes, with prefix caching, through a copy-on-write fork, under recompute and swap
# preemption and chunked prefill; then real CUDA graphs against --enforce-eager (gpu tests:
# they skip on CPU).
INVARIANCE_TESTS = (
    "tests/engine/test_invariance.py::test_block_sizes[1]",
    "tests/engine/test_invariance.py::test_block_sizes[16]",
    "tests/engine/test_invariance.py::test_prefix_caching_shared_system_prompt",
    "tests/engine/test_invariance.py::test_parallel_sampling_n2_greedy",
    "tests/engine/test_invariance.py::test_preemption_keeps_outputs",
    "tests/swap/test_swap_engine.py::test_swap_preemption_keeps_outputs",
    "tests/engine/test_invariance.py::test_chunked_prefill_budget_7",
    "tests/model/test_cuda_graphs.py::test_cuda_graphs_give_the_eager_tokens",
)


@dataclass
class Context:
    """One section's run: where results go, its shapes (smoke or not), its device and the
    moment its loops must stop (the process is killed a little later, at its budget)."""

    out_dir: Path
    smoke: bool
    device: torch.device
    deadline: float  # time.perf_counter() value
    _copy_bw: float | None = None
    _models: dict[tuple[str, str], tuple] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def left_s(self) -> float:
        return self.deadline - time.perf_counter()

    def over(self) -> bool:
        return self.left_s() <= 0

    def model(self, name: str, dtype: torch.dtype):
        """(model, tokenizer, config), loaded once per section."""
        from kvscope.engine.model import load_model

        key = (name, str(dtype))
        if key not in self._models:
            self.release()
            self._models[key] = load_model(name, device=self.device, dtype=dtype, seed=0)
        return self._models[key]

    def checkpoint(self, section: str, result: dict) -> None:
        """What a kill at the budget keeps: ``<section>.json`` as the result stands now, with
        status ``timeout`` (the run reads it back when it kills the section; the section's
        own final write replaces it)."""
        path = self.out_dir / f"{section}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({**result, "status": "timeout", "section": section},
                                  indent=1, default=str))
        tmp.replace(path)

    def release(self) -> None:
        """Drop loaded models and cached blocks before loading something else."""
        self._models.clear()
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


def meta(device: torch.device) -> dict:
    """Who measured: date, versions and the GPU's name (as nvidia-smi reports it). Triton's
    version from its metadata: importing it here would fix the interpreter setting."""
    from importlib.metadata import version

    m = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
         "python": platform.python_version(), "torch": torch.__version__,
         "triton": version("triton"), "device": str(device)}
    if device.type == "cuda":
        m |= {"gpu": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    return m


# ---------------------------------------------------------------- helpers
def sync(ctx: Context) -> None:
    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)


def bench_ms(ctx: Context, fn: Callable[[], Any], rep_ms: int = 60) -> float:
    """Median milliseconds of ``fn``: triton's do_bench (CUDA events, L2 flushed between
    runs) on a GPU, a wall clock around a synchronised call elsewhere."""
    if ctx.cuda:
        import inspect

        from triton.testing import do_bench

        if "return_mode" in inspect.signature(do_bench).parameters:
            return float(do_bench(fn, warmup=10, rep=rep_ms, return_mode="median"))
        return float(do_bench(fn, warmup=10, rep=rep_ms, quantiles=[0.5]))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def copy_bandwidth(ctx: Context) -> float:
    """Bytes/s of a device-to-device copy counting bytes read and written (METHOD.md): the
    device section's when it ran in this output folder, else measured here (~2 s)."""
    if ctx._copy_bw is None:
        device_json = ctx.out_dir / "device.json"
        if device_json.is_file():
            ctx._copy_bw = json.loads(device_json.read_text()).get("copy_bytes_per_s")
    if ctx._copy_bw is None:
        size = (16 << 20) if ctx.smoke else (2 << 30)
        src = torch.randint(0, 255, (size,), dtype=torch.uint8, device=ctx.device)
        dst = torch.empty_like(src)
        ms = bench_ms(ctx, lambda: dst.copy_(src), rep_ms=200)
        ctx._copy_bw = 2 * size / (ms * 1e-3)
        del src, dst
        ctx.release()
    return ctx._copy_bw


_OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")


def _gpu_only(test: str) -> bool:
    return "test_gpu_shapes.py" in test or "test_cuda_graphs.py" in test


def smoke_tests(tests: tuple[str, ...]) -> tuple[str, ...]:
    """What --smoke runs of a section's tests: the GPU-only ones (they skip on CPU, which
    proves they are collected) and the first of the rest (the rest run in ``make test``
    anyway; the smoke checks this script's plumbing, not the kernels again)."""
    rest = [t for t in tests if not _gpu_only(t)]
    return (*[t for t in tests if _gpu_only(t)], *rest[:1])


def run_pytest(ctx: Context, tests: tuple[str, ...], env: dict[str, str]) -> dict:
    """pytest over ``tests`` in a child process (its own environment, killed at the
    section's deadline); with --smoke, ``smoke_tests(tests)``. Counts come from the
    per-test lines of ``-v`` (so a killed run still counts what finished); the whole
    output goes to this process's stdout, which gpu_check.py appends to the run's log."""
    if ctx.smoke:
        tests = smoke_tests(tests)
    cmd = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-rfEs", *tests]
    child_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
    if not ctx.smoke:
        child_env.pop("TRITON_INTERPRET", None)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=child_env, capture_output=True, text=True,
                              timeout=max(ctx.left_s(), 5))
        out, rc, timed_out = proc.stdout + proc.stderr, proc.returncode, False
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc, timed_out = None, True
    print(out, flush=True)
    outcomes: dict[str, str] = {}
    for line in out.splitlines():
        m = _OUTCOME.match(line)
        if m:
            outcomes[m.group(1)] = m.group(2)
    counts = {k: sum(v == k.upper() for v in outcomes.values())
              for k in ("passed", "failed", "skipped", "error")}
    failures = [line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))]
    ok = rc == 0 and not timed_out and counts["passed"] > 0
    return {"status": "ok" if ok else ("timeout" if timed_out else "fail"),
            "returncode": rc, "pytest_s": round(time.perf_counter() - t0, 1), **counts,
            "failures": failures[:40], "tests": list(tests), "env": env,
            "skipped_tests": [t for t, v in outcomes.items() if v == "SKIPPED"],
            "summary": f"{counts['passed']} passed, {counts['failed']} failed, "
                       f"{counts['error']} errors, {counts['skipped']} skipped"
                       + (" (TIMED OUT: the rest did not run)" if timed_out else "")}


def cli_json(argv: list[str]) -> dict:
    """Run a `kvscope` command in this process and parse the one JSON object it prints."""
    from kvscope.engine.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(argv)
    text = buf.getvalue()
    if rc != 0:
        raise RuntimeError(f"kvscope {' '.join(argv)} exited {rc}: {text[-2000:]}")
    return json.loads(text[text.index("{"):])


def _prompts(n: int, vocab: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(8, 120))]}
            for _ in range(n)]


# ---------------------------------------------------------------- run 1
def section_device(ctx: Context) -> dict:
    r: dict[str, Any] = {}
    if ctx.cuda:
        props = torch.cuda.get_device_properties(ctx.device)
        r |= {"name": props.name, "capability": f"{props.major}.{props.minor}",
              "multiprocessors": props.multi_processor_count,
              "memory_gib": round(props.total_memory / (1 << 30), 1),
              "l2_mib": round(getattr(props, "L2_cache_size", 0) / (1 << 20), 1)}
    else:
        r["name"] = platform.processor() or platform.machine()
    bw = copy_bandwidth(ctx)
    r |= {"copy_bytes_per_s": bw, "copy_tb_s": round(bw / 1e12, 3)}
    if ctx.cuda:  # pinned host <-> device, one way each (the swap tier's ceiling)
        n = 1 << 30
        host = torch.randint(0, 255, (n,), dtype=torch.uint8).pin_memory()
        dev = torch.empty(n, dtype=torch.uint8, device=ctx.device)
        r["h2d_gb_s"] = round(n / (bench_ms(ctx, lambda: dev.copy_(host, non_blocking=True))
                                   * 1e-3) / 1e9, 1)
        r["d2h_gb_s"] = round(n / (bench_ms(ctx, lambda: host.copy_(dev, non_blocking=True))
                                   * 1e-3) / 1e9, 1)
        del host, dev
    size = 256 if ctx.smoke else 8192
    dtype = torch.bfloat16  # the GPU dtype, on CPU too in --smoke (dtype errors show here)
    mats = [torch.randn(size, size, device=ctx.device, dtype=dtype) for _ in "ab"]  # never 0s
    ms = bench_ms(ctx, lambda: mats[0] @ mats[1])
    r["matmul_tflop_s"] = round(2 * size ** 3 / (ms * 1e-3) / 1e12, 2)
    mats.clear()
    ctx.release()
    r["summary"] = (f"{r['name']}: copy {r['copy_tb_s']} TB/s, matmul "
                    f"{r['matmul_tflop_s']} TFLOP/s"
                    + (f", pinned H2D {r['h2d_gb_s']} / D2H {r['d2h_gb_s']} GB/s"
                       if ctx.cuda else ""))
    return r


def section_kernels(ctx: Context) -> dict:
    # tests/kernels' conftest runs the Triton kernels on the GPU when there is one, else
    # under the interpreter
    return run_pytest(ctx, KERNEL_TESTS, {})


def section_invariance(ctx: Context) -> dict:
    env = {"KVSCOPE_TEST_MODEL": TINY if ctx.smoke else SMALL,
           "KVSCOPE_TEST_DEVICE": ctx.device.type, "KVSCOPE_TEST_DTYPE": "float32"}
    return run_pytest(ctx, INVARIANCE_TESTS, env)


def section_decode(ctx: Context) -> dict:
    """The 8B-shaped decode step (ModelRunner.execute: forward + logits) at batch 1..256,
    eager and replaying its CUDA graph, against its floor; then the host syncs of real
    engine decode steps, eager and with graphs."""
    from kvscope.engine.cache.spec import KVSpec
    from kvscope.engine.model.dummy import weight_bytes
    from kvscope.engine.runner.model_runner import ModelRunner, StepBatch
    from kvscope.engine.runner.page_format import page_format

    name = TINY if ctx.smoke else BIG
    dtype = torch.bfloat16  # the GPU dtype, on CPU too in --smoke (dtype errors show here)
    batches, context = ((1, 4), 64) if ctx.smoke else ((1, 8, 64, 256), 2048)
    loaded = ctx.model(name, dtype)
    model, _, cfg = loaded
    bs = 16
    fmt = page_format("auto", dtype, cfg, bs)
    need = max(batches) * -(-context // bs)
    free = torch.cuda.mem_get_info(ctx.device)[0] if ctx.cuda else 1 << 34
    headroom = 8 << 30 if ctx.cuda else 0  # activations and logits at batch 256
    num_blocks = max(1, min(need, (free - headroom) // fmt.bytes_per_block))
    # the default: CUDA graphs for the decode step (engine.runner.cuda_graphs); none on CPU
    # (--smoke), which measures the eager rows only
    spec = KVSpec(bs, num_blocks, format=fmt.name, page=fmt)
    runner = ModelRunner(model, cfg, spec, ctx.device, max_model_len=context,
                         max_num_seqs=max(batches))
    graphs = runner.graphs
    for t in runner.kv.per_block_tensors:  # attention over random keys, never zeros
        t.normal_()
    bw = copy_bandwidth(ctx)
    w_bytes = weight_bytes(cfg, dtype.itemsize)
    rows = []
    breakdown = None
    for batch in batches:
        if ctx.over():
            break
        ctx_len = min(context, (num_blocks // batch) * bs)
        pages = -(-ctx_len // bs)
        table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
        pos = torch.full((batch,), ctx_len - 1, dtype=torch.int64)
        dev = ctx.device
        step = StepBatch(
            input_ids=torch.randint(3, cfg.vocab_size, (batch,), device=dev),
            positions=pos.to(dev),
            slot_mapping=(table[:, -1].long() * bs + (ctx_len - 1) % bs).to(dev),
            block_tables=table.to(dev),
            seq_lens=torch.full((batch,), ctx_len, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=dev),
            sample_index=torch.arange(batch, device=dev))
        runner.graphs = None
        ms = bench_ms(ctx, lambda step=step, run=runner: run.execute(step), rep_ms=300)
        graph_ms = None
        if graphs is not None:
            runner.graphs = graphs
            runner.execute(step)  # the bucket's capture, outside the timing
            graph_ms = bench_ms(ctx, lambda step=step, run=runner: run.execute(step),
                                rep_ms=300)
        ms_best = min(ms, graph_ms) if graph_ms else ms
        if batch == PROFILED_BATCH[ctx.smoke] and not ctx.over():
            runner.graphs = None  # eager: the profiler sees each kernel by name
            try:  # a probe: its failure must not cost the section its rows
                breakdown = _kernel_breakdown(ctx, lambda step=step, run=runner:
                                              run.execute(step))
            except Exception as e:  # noqa: BLE001 - reported in the JSON
                breakdown = {"error": repr(e)[:500]}
            runner.graphs = graphs
        kv_bytes = batch * ctx_len * fmt.bytes_per_block // bs
        floor_ms = (w_bytes + kv_bytes) / bw * 1e3
        rows.append({"batch": batch, "context": ctx_len, "step_ms": round(ms, 3),
                     **({"graph_step_ms": round(graph_ms, 3),
                         "graph_speedup": round(ms / graph_ms, 2)} if graph_ms else {}),
                     "floor_ms": round(floor_ms, 3), "x_floor": round(ms_best / floor_ms, 2),
                     "weight_gb": round(w_bytes / 1e9, 2), "kv_gb": round(kv_bytes / 1e9, 2),
                     "tokens_per_s": round(batch / (ms_best * 1e-3), 1),
                     **({"context_reduced_to_fit": True} if ctx_len < context else {})})
    buckets = sorted(graphs.graphs) if graphs is not None else None
    runner = graphs = None  # free the pages (the model stays) before the engines below
    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
    # graphs (the default): CUDA only; on CPU the default is eager
    syncs = {mode: _decode_syncs(ctx, loaded, enforce_eager=True if mode == "eager" else None)
             for mode in (("eager", "graphs") if ctx.cuda else ("eager",))
             if not ctx.over()}
    at64 = next((r for r in rows if r["batch"] == 64), None)
    r = {"model": name, "dtype": str(dtype).split(".")[-1], "copy_tb_s": round(bw / 1e12, 3),
         "rows": rows, "measures": "ModelRunner.execute: forward + logits; step_ms eager, "
                                   "graph_step_ms replaying the bucket's CUDA graph; x_floor "
                                   "of the faster; floor = (weight + KV bytes) / copy bw",
         **({"graph_buckets_captured": buckets} if buckets is not None else {}),
         "syncs": syncs, "kernel_breakdown": breakdown,
         "goal": "<= 1.3x the floor at batch 64 (graphs); no host sync in the step but the "
                 "sampled ids"}
    if at64:
        r["goal_met"] = at64["x_floor"] <= 1.3
    r["summary"] = ", ".join(
        f"B{x['batch']} {x['step_ms']:.1f}"
        + (f"/{x['graph_step_ms']:.1f}" if "graph_step_ms" in x else "")
        + f" ms ({x['x_floor']}x floor)" for x in rows) + (
        " [eager/graphs]" if buckets is not None else "") + "; syncs/step " + ", ".join(
        f"{mode} {m['syncs_per_step']:.1f}" for mode, m in syncs.items())
    return r


PROFILED_BATCH = {False: 64, True: 4}  # the decode row whose step is profiled (by smoke)
# kernel (or, on CPU, op) names -> the part of the step they are
PARTS = (("attention", re.compile(r"decode_split|decode_reduce|paged|attention|sdpa", re.I)),
         ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|matmul|\bmm\b|addmm|linear", re.I)),
         ("cache write", re.compile(r"cache|scatter|index_put|copy_", re.I)))


def _kernel_breakdown(ctx: Context, step: Callable[[], Any], steps: int = 3) -> dict:
    """Where one eager decode step's device time goes (torch.profiler over ``steps`` steps,
    per kernel, then summed into attention / matmul / cache write / other). On CPU
    (--smoke) the same for the ops' own CPU time. Graph replays run these same kernels
    without the launch gaps, so the parts are what a graph step spends."""
    from torch.profiler import ProfilerActivity, profile

    step()  # compiled and warm outside the trace
    sync(ctx)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
        sync(ctx)
    per_kernel: dict[str, float] = {}
    for ev in prof.key_averages():
        if ctx.cuda:
            us = getattr(ev, "self_device_time_total", None)
            if us is None:
                us = getattr(ev, "self_cuda_time_total", 0.0)
        else:
            us = ev.self_cpu_time_total
        # on CUDA only the kernels themselves (an aten op's device time is its kernels':
        # counted once)
        if us > 0 and (not ctx.cuda or str(getattr(ev, "device_type", "")).endswith("CUDA")):
            per_kernel[ev.key] = per_kernel.get(ev.key, 0.0) + us
    parts = dict.fromkeys([p for p, _ in PARTS] + ["other"], 0.0)
    for name, us in per_kernel.items():
        part = next((p for p, pat in PARTS if pat.search(name)), "other")
        parts[part] += us
    total = sum(parts.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
    return {"time": "device" if ctx.cuda else "cpu (smoke)", "steps": steps,
            "ms_per_step": round(total / steps / 1e3, 3),
            "parts_ms_per_step": {p: round(us / steps / 1e3, 3) for p, us in parts.items()},
            "top_kernels_ms_per_step": [{"name": n[:120], "ms": round(us / steps / 1e3, 3)}
                                        for n, us in top]}


def _decode_syncs(ctx: Context, loaded, enforce_eager: bool | None) -> dict:
    """Every synchronising CUDA call made during pure-decode engine steps, counted with
    ``torch.cuda.set_sync_debug_mode("warn")`` (a warning per sync, raised at the Python
    line that caused it). On CPU nothing synchronises: the count is 0."""
    import warnings
    from collections import Counter

    from kvscope.engine.config import EngineConfig
    from kvscope.engine.engine import LLMEngine
    from kvscope.engine.sampling_params import SamplingParams

    batch, steps = 8, 8
    eng = LLMEngine(EngineConfig(device=str(ctx.device), dtype=loaded[0].dtype,
                                 num_gpu_blocks=256, enable_prefix_caching=False,
                                 enforce_eager=enforce_eager), loaded=loaded)
    params = SamplingParams(temperature=0.0, max_tokens=4 * steps, ignore_eos=True)
    for i, p in enumerate(_prompts(batch, loaded[2].vocab_size, seed=1)):
        eng.add_request(str(i), p, params)
    for _ in range(200):  # prefill everything, then two warm decode steps (graph captured)
        eng.step()
        if all(len(s.output_token_ids) >= 2 for s in eng.scheduler.running) and \
                len(eng.scheduler.running) == batch:
            break
    sites: Counter[str] = Counter()
    sync(ctx)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if ctx.cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                eng.step()
        finally:
            if ctx.cuda:
                torch.cuda.set_sync_debug_mode("default")
    for w in caught:
        if "synchroniz" in str(w.message):
            path = Path(w.filename)
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            sites[f"{where}:{w.lineno}"] += 1
    graphs = eng.runner.graphs
    eng.close()
    return {"batch": batch, "steps": steps, "syncs_per_step": sum(sites.values()) / steps,
            "sites": dict(sites.most_common(15)),
            **({"graph_replays": graphs.replays} if graphs is not None else {})}


def _paged_case(ctx: Context, fmt: str, batch: int, context: int, hkv: int, head_dim: int,
                block: int):
    """A decode batch over pages of ``fmt`` (1 layer): every slot written through
    kernels.reshape_and_cache from random K/V, pages a random permutation of the pool."""
    from kvscope import kernels
    from kvscope.engine.runner.page_format import PageFormat

    pages_per_seq = -(-context // block)
    num_blocks = batch * pages_per_seq
    fmt_ = PageFormat(fmt, torch.bfloat16, 1, block, hkv, head_dim)
    kv = fmt_.allocate(num_blocks, ctx.device)
    slots = num_blocks * block
    chunk = 1 << 18
    gen = torch.Generator(device=ctx.device).manual_seed(batch * 7 + context)
    for start in range(0, slots, chunk):
        n = min(chunk, slots - start)
        k = torch.randn(n, hkv, head_dim, device=ctx.device, dtype=torch.bfloat16,
                        generator=gen)
        v = torch.randn(n, hkv, head_dim, device=ctx.device, dtype=torch.bfloat16,
                        generator=gen)
        slot = torch.arange(start, start + n, device=ctx.device)
        kernels.reshape_and_cache(k, v, kv.k_caches[0], kv.v_caches[0], slot,
                                  k_scale=kv.k_scales[0] if kv.k_scales else None,
                                  v_scale=kv.v_scales[0] if kv.v_scales else None)
    perm = torch.randperm(num_blocks, device="cpu").view(batch, pages_per_seq)
    tables = perm.to(device=ctx.device, dtype=torch.int32)
    kv_bytes = 2 * batch * context * hkv * fmt_.bytes_per_token_head
    return kv, tables, kv_bytes


def section_attention(ctx: Context) -> dict:
    import torch.nn.functional as F

    from kvscope import kernels

    if ctx.smoke:
        hq, hkv, d, block = 4, 2, 16, 16
        batches, contexts = (1, 2), (32,)
    else:
        hq, hkv, d, block = 32, 8, 128, 16
        batches, contexts = (32, 128), (4096, 16384)
    formats = ("auto", "int8")
    bw = copy_bandwidth(ctx)
    scale = d ** -0.5
    rows, truncated = [], False
    for context in contexts:
        for batch in batches:
            if ctx.over():
                truncated = True
                break
            row: dict[str, Any] = {"batch": batch, "context": context}
            rows.append(row)
            q = torch.randn(batch, hq, d, device=ctx.device, dtype=torch.bfloat16)
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device=ctx.device)
            cu = torch.arange(batch + 1, dtype=torch.int32, device=ctx.device)
            out = torch.empty_like(q)
            for fmt in formats:
                kv, tables, kv_bytes = _paged_case(ctx, fmt, batch, context, hkv, d, block)
                scales = {"k_scale": kv.k_scales[0] if kv.k_scales else None,
                          "v_scale": kv.v_scales[0] if kv.v_scales else None}
                args = (q, kv.k_caches[0], kv.v_caches[0], tables, seq_lens, cu, scale)
                with kernels.force_backend("triton"):
                    ms = bench_ms(ctx, lambda args=args, out=out, scales=scales:
                                  kernels.paged_attention(*args, out=out, **scales))
                row[fmt] = {"ms": round(ms, 4), "kv_bytes": kv_bytes,
                            "bw_fraction": round(kv_bytes / (ms * 1e-3) / bw, 3)}
                if fmt == "auto":  # the same keys, contiguous, through SDPA
                    row["sdpa"] = _sdpa_row(ctx, q, kv, tables, context, scale, kv_bytes, bw,
                                            F)
                del kv, tables, args
                ctx.release()
            row["int8"]["speedup_vs_bf16"] = round(row["auto"]["ms"] / row["int8"]["ms"], 2)
            row["int8"]["byte_ratio"] = round(row["auto"]["kv_bytes"] /
                                              row["int8"]["kv_bytes"], 2)
    done = [r for r in rows if "int8" in r]
    big = [r for r in done if r["batch"] >= 32 and r["context"] >= 4096]
    sweep = [] if truncated else _split_sweep(ctx, formats, batches[0], contexts[0], hkv, d,
                                              block, hq, scale, bw)
    launches = [] if truncated else _launch_sweep(ctx, formats, batches[0], contexts[0], hkv,
                                                  d, block, hq, scale, bw)
    r: dict[str, Any] = {
        "shapes": {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "block_size": block},
        "copy_tb_s": round(bw / 1e12, 3), "rows": rows, "truncated": truncated,
        "split_sweep": sweep, "launch_sweep": launches,
        "goal": "bf16 pages >= 85% of copy bandwidth at batch >= 32, context >= 4k; int8 "
                "pages' speedup over bf16 >= 85% of their byte ratio"}
    if big:
        worst = min(x["auto"]["bw_fraction"] for x in big)
        proportion = min(x["int8"]["speedup_vs_bf16"] / x["int8"]["byte_ratio"] for x in big)
        r |= {"worst_bf16_bw_fraction": worst, "worst_int8_speedup_per_byte_ratio":
              round(proportion, 2), "goal_met": worst >= 0.85 and proportion >= 0.85}
    r["summary"] = "; ".join(
        f"B{x['batch']} L{x['context'] // 1024}k bf16 {100 * x['auto']['bw_fraction']:.0f}% "
        f"(SDPA {100 * x['sdpa']['bw_fraction']:.0f}%), int8 {x['int8']['speedup_vs_bf16']}x/"
        f"{x['int8']['byte_ratio']}x bytes" for x in done) + (
        " (of copy bw); truncated by the budget" if truncated else " (of copy bw)")
    return r


# (num_warps, num_stages) the launch sweep tries; (None, None) = Triton's defaults
LAUNCHES = ((None, None), (4, 2), (4, 4), (8, 2), (8, 3), (8, 4))


def launches(smoke: bool) -> tuple[tuple[int | None, int | None], ...]:
    """The launch sweep's configurations: all on the GPU; in --smoke (the interpreter,
    which ignores them) two, enough to prove the plumbing."""
    return LAUNCHES[:2] if smoke else LAUNCHES


def _split_sweep(ctx: Context, formats, batch: int, context: int, hkv: int, d: int,
                 block: int, hq: int, scale: float, bw: float) -> list[dict]:
    """Decode time by split count at the smallest batch and context (where the first H200
    run was furthest from the copy bandwidth: 74% at B32 x 4k with the default 3 splits):
    whether the split heuristic (kernels.triton_attention.default_num_splits) is the gap."""
    from kvscope.kernels.triton_attention import default_num_splits

    block_n = 16 if ctx.smoke else 64
    default = default_num_splits(ctx.device, batch, hkv, context, block_n)
    counts = sorted({1, default, 2 * default, 4 * default, max(1, context // (4 * block_n)),
                     max(1, context // (2 * block_n))})
    variants = [({"splits": n, "default": n == default}, {"num_splits": n}, {})
                for n in counts]
    return _decode_sweep(ctx, formats, batch, context, hkv, d, block, hq, scale, bw,
                         variants)


def _launch_sweep(ctx: Context, formats, batch: int, context: int, hkv: int, d: int,
                  block: int, hq: int, scale: float, bw: float) -> list[dict]:
    """Decode time by the split kernel's launch configuration (warps, pipeline stages) at
    the default split count, bf16 and int8 pages, at the sweep's shape: whether the gap to
    copy bandwidth (bf16 74%, int8 0.4-0.5x bf16's speed on the first H200 run) is the
    launch configuration rather than the kernel's body."""
    variants = [({"num_warps": w or "default", "num_stages": n or "default"}, {},
                 {k: v for k, v in (("num_warps", w), ("num_stages", n)) if v is not None})
                for w, n in launches(ctx.smoke)]
    return _decode_sweep(ctx, formats, batch, context, hkv, d, block, hq, scale, bw,
                         variants)


def _decode_sweep(ctx: Context, formats, batch: int, context: int, hkv: int, d: int,
                  block: int, hq: int, scale: float, bw: float,
                  variants: list[tuple[dict, dict, dict]]) -> list[dict]:
    """Paged decode time per page format and variant: (the row's fields, extra
    ``paged_attention`` arguments, ``decode_launch`` options). A variant that fails (a
    configuration that does not fit the SM) gets its error in its row, not the section's."""
    from kvscope import kernels
    from kvscope.kernels.triton_attention import decode_launch

    q = torch.randn(batch, hq, d, device=ctx.device, dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=ctx.device)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=ctx.device)
    out = torch.empty_like(q)
    rows = []
    for fmt in formats:
        kv, tables, kv_bytes = _paged_case(ctx, fmt, batch, context, hkv, d, block)
        scales = {"k_scale": kv.k_scales[0] if kv.k_scales else None,
                  "v_scale": kv.v_scales[0] if kv.v_scales else None}
        args = (q, kv.k_caches[0], kv.v_caches[0], tables, seq_lens, cu, scale)
        for fields, extra, launch in variants:
            if ctx.over():
                break
            row = {"format": fmt, "batch": batch, "context": context, **fields}
            try:
                with kernels.force_backend("triton"), decode_launch(**launch):
                    ms = bench_ms(ctx, lambda args=args, extra=extra, scales=scales:
                                  kernels.paged_attention(*args, out=out, **extra, **scales))
            except Exception as e:  # noqa: BLE001 - reported in the JSON
                rows.append(row | {"error": repr(e)[:300]})
                continue
            rows.append(row | {"ms": round(ms, 4),
                               "bw_fraction": round(kv_bytes / (ms * 1e-3) / bw, 3)})
        del kv, tables, args
        ctx.release()
    return rows


def _sdpa_row(ctx, q, kv, tables, context, scale, kv_bytes, bw, F) -> dict:
    """torch SDPA (flash backend where it takes the call) on a contiguous [B, Hkv, L, D]
    cache holding the paged keys in order. GQA as a short query: q viewed [B, Hkv, G, D]
    attends all L keys without a mask, exactly what decode computes."""
    batch, hq, d = q.shape
    hkv = kv.k_caches[0].shape[2]
    pages = tables.long()
    k = kv.k_caches[0][pages].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    v = kv.v_caches[0][pages].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()
    q4 = q.view(batch, hkv, hq // hkv, d)

    def sdpa():
        return F.scaled_dot_product_attention(q4, k, v, scale=scale)

    backend = "default"
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            sdpa()
        backend = "flash"
    except (ImportError, RuntimeError):
        pass
    if backend == "flash":
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ms = bench_ms(ctx, sdpa)
    else:
        ms = bench_ms(ctx, sdpa)
    return {"ms": round(ms, 4), "backend": backend,
            "bw_fraction": round(kv_bytes / (ms * 1e-3) / bw, 3)}


def section_events(ctx: Context) -> dict:
    from bench_publish_overhead import measure_overhead

    name = TINY if ctx.smoke else BIG
    dtype = torch.bfloat16  # the GPU dtype, on CPU too in --smoke (dtype errors show here)
    loaded = ctx.model(name, dtype)
    requests, tokens, blocks = (4, 4, 64) if ctx.smoke else (64, 192, 4096)
    r = measure_overhead(loaded, requests, tokens, str(ctx.device), dtype, num_blocks=blocks,
                         until=ctx.deadline)
    r |= {"model": name, "goal": "events + recording on: <= 1% step time",
          "goal_met": r["overhead_pct"] <= 1.0}
    r["summary"] = (f"median step {r['step_ms_off']} ms off / {r['step_ms_on']} ms on "
                    f"({r['overhead_pct']:+.1f}%) over {r['steps']} steps, "
                    f"{r['events_per_s_at_step_rate']:.0f} events/s at the engine's step rate")
    return r


# ---------------------------------------------------------------- run 2
def section_offline(ctx: Context) -> dict:
    from kvscope.engine.bench.capacity import make_workload

    name = TINY if ctx.smoke else BIG
    dtype = torch.bfloat16  # the GPU dtype, on CPU too in --smoke (dtype errors show here)
    n, max_len, hf_batch = (6, 128, 4) if ctx.smoke else (128, 2048, 32)
    loaded = ctx.model(name, dtype)
    workload = make_workload(n, 0, loaded[2].vocab_size, max_len)
    useful = sum(out for _, out in workload)
    r: dict[str, Any] = {"model": name, "requests": n, "output_tokens": useful,
                         "prompt_tokens": sum(len(p) for p, _ in workload),
                         "workload": "kvscope bench capacity's lognormal mix, seed 0"}
    r["kvscope"] = _kvscope_offline(ctx, loaded, workload, max_len)
    ks = r["kvscope"]["tokens_per_s"]
    ctx.checkpoint("offline", {**r, "summary": f"kvscope {ks:.0f} tok/s; HF generate did not "
                                               "finish inside the budget"})
    loaded = None  # HF's model takes the memory next
    ctx.release()
    if importlib.util.find_spec("transformers") is None:
        r["hf"] = "not available (transformers is not installed here)"
    else:
        r["hf"] = _hf_offline(ctx, name, dtype, workload, hf_batch)
    if isinstance(r["hf"], dict) and r["hf"].get("tokens_per_s"):
        r["ratio"] = round(ks / r["hf"]["tokens_per_s"], 2)
        r["goal_met"] = r["ratio"] >= 3
    r["goal"] = "kvscope >= 3x HF generate (static cache, batched)"
    r["summary"] = f"kvscope {ks:.0f} tok/s" + (
        f", HF {r['hf']['tokens_per_s']:.0f} tok/s = {r['ratio']}x" if "ratio" in r
        else f", HF: {r['hf'] if isinstance(r['hf'], str) else r['hf'].get('error', '?')}")
    return r


def _kvscope_offline(ctx: Context, loaded, workload, max_len: int) -> dict:
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.engine import LLMEngine
    from kvscope.engine.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(device=str(ctx.device), dtype=loaded[0].dtype,
                                 max_model_len=max_len, enable_prefix_caching=False,
                                 **({"num_gpu_blocks": 256} if ctx.smoke else {})),
                    loaded=loaded)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i in range(2):  # compile the kernels outside the timed run
        eng.add_request(f"warm{i}", {"prompt_token_ids": workload[i][0]}, warm)
    while eng.has_unfinished_requests():
        eng.step()
    for i, (ids, out_len) in enumerate(workload):
        eng.add_request(str(i), {"prompt_token_ids": ids},
                        SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True))
    generated, steps = 0, 0
    sync(ctx)
    t0 = time.perf_counter()
    while eng.has_unfinished_requests() and not ctx.over():
        for out in eng.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
        steps += 1
    sync(ctx)
    wall = time.perf_counter() - t0
    result = {"tokens_per_s": round(generated / wall, 1), "wall_s": round(wall, 2),
              "generated": generated, "steps": steps,
              "kv_capacity_tokens": eng.cache_capacity_tokens,
              "preemptions": eng.scheduler.num_preemptions,
              "truncated_by_budget": eng.has_unfinished_requests()}
    eng.close()
    del eng
    return result


def _hf_offline(ctx: Context, name: str, dtype: torch.dtype, workload, batch: int) -> dict:
    """HF transformers generate on a LlamaForCausalLM of the same shapes (its own random
    weights), left-padded batches in workload order, each batch generating its longest
    requested output; only the requested tokens count. Stops between batches at the
    section's deadline (the rate of the batches done is the number)."""
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM

        from kvscope.engine.model.dummy import PRESETS

        hf_cfg = dict(PRESETS[name.split(":", 1)[1]])
        hf_cfg.pop("model_type")
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(ctx.device):
                model = LlamaForCausalLM(LlamaConfig(**hf_cfg)).eval()
        finally:
            torch.set_default_dtype(default)
    except Exception as e:  # an API change between transformers versions: report it
        return {"error": f"could not build the HF model: {type(e).__name__}: {e}"}
    cache = "static"
    holder = [model]  # (dropped after the run, so its memory goes with it)

    def generate(ids: list[list[int]], new: int):
        model = holder[0]
        nonlocal cache
        width = max(len(x) for x in ids)
        input_ids = torch.zeros(len(ids), width, dtype=torch.long)
        mask = torch.zeros(len(ids), width, dtype=torch.long)
        for i, x in enumerate(ids):  # left padding
            input_ids[i, width - len(x):] = torch.tensor(x)
            mask[i, width - len(x):] = 1
        # disable_compile: with a static cache transformers torch.compiles the forward on
        # its own; for an 8B model that compile (and a recompile per batch shape) outlasted
        # the whole section on the first device run (2026-11-27). HF runs eagerly, as
        # kvscope's comparison on CPU does.
        kw = dict(input_ids=input_ids.to(ctx.device), attention_mask=mask.to(ctx.device),
                  max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                  disable_compile=True)
        if cache == "static":
            try:
                return model.generate(**kw, cache_implementation="static")
            except Exception as e:  # noqa: BLE001  (report, then measure the default cache)
                cache = f"dynamic (static failed: {type(e).__name__}: {str(e)[:200]})"
        return model.generate(**kw)

    done, completed = 0, 0
    with torch.inference_mode():
        generate([workload[0][0][:16]], 2)  # warm-up
        sync(ctx)
        t0 = time.perf_counter()
        for start in range(0, len(workload), batch):
            if ctx.over():
                break
            chunk = workload[start:start + batch]
            generate([p for p, _ in chunk], max(o for _, o in chunk))
            done += sum(o for _, o in chunk)
            completed += len(chunk)
        sync(ctx)
        wall = time.perf_counter() - t0
    holder.clear()
    del model
    ctx.release()
    return {"transformers": transformers.__version__, "cache": cache, "batch": batch,
            "requests_done": completed, "generated_useful": done, "wall_s": round(wall, 2),
            "tokens_per_s": round(done / wall, 1) if done else None,
            "truncated_by_budget": completed < len(workload)}


def section_capacity(ctx: Context) -> dict:
    if ctx.smoke:
        argv = ["--model", TINY, "--num-requests", "6", "--budget-tokens", "1024",
                "--max-model-len", "256"]
    else:  # 4 GiB of bf16 8B KV (128 KiB a token): 32768 tokens, 16 contiguous 2k slots
        argv = ["--model", BIG, "--num-requests", "64", "--budget-tokens", "32768",
                "--max-model-len", "2048"]
    r = cli_json(["bench", "capacity", *argv, "--json"])
    r["command"] = "kvscope bench capacity " + " ".join(argv)
    r["summary"] = (f"peak running {r['paged_peak_running']} vs {r['contiguous_peak_running']}"
                    f" ({r['concurrency_ratio']:.1f}x), waste {r['paged_waste_pct']}% vs "
                    f"{r['contiguous_waste_pct']}%, {r['paged_tokens_per_s']} vs "
                    f"{r['contiguous_tokens_per_s']} tok/s")
    return r


def section_swap(ctx: Context) -> dict:
    if ctx.smoke:
        argv = ["--model", TINY, "--pool-blocks", "64", "--prefix-tokens", "64", "--repeat",
                "1"]
    else:  # 2 MiB blocks: a 2 GiB pool, 1 GiB moved each way
        argv = ["--model", BIG, "--pool-blocks", "1024", "--swap-blocks", "512",
                "--prefix-tokens", "2048"]
    r = cli_json(["bench", "swap", *argv, "--json"])
    r["command"] = "kvscope bench swap " + " ".join(argv)
    r["goal"] = "swap >= 80% of a pinned copy_ each way"
    r["goal_met"] = r["swap_out_vs_copy"] >= 0.8 and r["swap_in_vs_copy"] >= 0.8
    r["summary"] = (f"out {r['swap_out_gb_s']:.1f} GB/s ({100 * r['swap_out_vs_copy']:.0f}% "
                    f"of copy), in {r['swap_in_gb_s']:.1f} GB/s "
                    f"({100 * r['swap_in_vs_copy']:.0f}%); TTFT host hit "
                    f"{r.get('ttft_host_hit_s', math.nan) * 1e3:.0f} ms vs recompute "
                    f"{r.get('ttft_recompute_s', math.nan) * 1e3:.0f} ms")
    return r


def _greedy_tokens(ctx: Context, loaded, prompts: list[dict], max_tokens: int,
                   **engine_kwargs) -> list[list[int]]:
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.engine import LLMEngine
    from kvscope.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    eng = LLMEngine(EngineConfig(device=str(ctx.device), dtype=loaded[0].dtype,
                                 max_model_len=512, **engine_kwargs), loaded=loaded)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    eng.close()
    return [done[str(i)] for i in range(len(prompts))]


def _agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Identical sequences, and the mean share of tokens before the first difference."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = []
    for x, y in zip(a, b, strict=True):
        k = next((i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), len(x))
        prefix.append(k / max(len(x), 1))
    return {"identical": f"{same}/{len(a)}", "mean_common_prefix": round(sum(prefix) /
                                                                         len(prefix), 3)}


def section_quant(ctx: Context) -> dict:
    from kvscope.engine.runner.page_format import check_supported

    n, tokens = (4, 6) if ctx.smoke else (16, 32)
    name = TINY if ctx.smoke else SMALL
    r: dict[str, Any] = {"model": name, "prompts": n, "max_tokens": tokens}
    blocks = {"num_gpu_blocks": 512}
    # fp32: the paged cache must not change a single greedy token against contiguous
    fp32 = ctx.model(name, torch.float32)
    prompts = _prompts(n, fp32[2].vocab_size)
    paged = _greedy_tokens(ctx, fp32, prompts, tokens, **blocks)
    contiguous = _greedy_tokens(ctx, fp32, prompts, tokens, kv_layout="contiguous", **blocks)
    r["fp32_paged_vs_contiguous"] = _agreement(paged, contiguous)
    identical = paged == contiguous
    # bf16 model (what a GPU runs; on CPU too in --smoke, to catch dtype errors):
    # quantized pages against bf16 pages, same weights
    dtype = torch.bfloat16
    model = ctx.model(name, dtype)
    base = _greedy_tokens(ctx, model, prompts, tokens, **blocks)
    r["model_dtype"] = str(dtype).split(".")[-1]
    r["contiguous_vs_paged"] = _agreement(
        _greedy_tokens(ctx, model, prompts, tokens, kv_layout="contiguous", **blocks), base)
    for fmt in ("fp8", "int8", "int4"):
        try:
            check_supported(fmt, ctx.device)
        except ValueError as e:
            r[fmt] = f"unsupported: {e}"
            continue
        r[fmt] = _agreement(_greedy_tokens(ctx, model, prompts, tokens, kv_cache_dtype=fmt,
                                           **blocks), base)
    r["status"] = "ok" if identical else "fail"
    r["summary"] = (f"fp32 paged==contiguous {r['fp32_paged_vs_contiguous']['identical']}; "
                    + ", ".join(f"{f} {r[f]['mean_common_prefix']:.2f}"
                                for f in ("fp8", "int8", "int4") if isinstance(r[f], dict))
                    + f" of tokens agree with {r['model_dtype']} pages")
    return r


RUNNERS: dict[str, Callable[[Context], dict]] = {
    "device": section_device, "kernels": section_kernels, "invariance": section_invariance,
    "decode": section_decode, "attention": section_attention, "events": section_events,
    "offline": section_offline, "capacity": section_capacity, "swap": section_swap,
    "quant": section_quant,
}
