"""Where kvscope's CPU decode step spends its time: N sequences, prefill done, then
--steps decode steps under torch.profiler (op self time) and cProfile (Python time by
file). Prints both tables; nothing is asserted. ``--prefill`` profiles the prefill steps
of the N prompts instead (one unprofiled warm-up round of N other prompts first).

    .venv/bin/python scripts/profile_cpu_decode.py [--seqs 32] [--steps 20] [--threads 2]
        [--dtype float32] [--context 128] [--prefill]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections import defaultdict


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    p.add_argument("--prefill", action="store_true", help="profile the prompts' prefill")
    args = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvscope.engine import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM("smollm2", device="cpu", dtype=args.dtype)
    eng = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True)
    if args.prefill:
        return _profile_prefill(eng, args)
    for i in range(args.seqs):  # distinct prompts: no prefix sharing
        eng.add_request(str(i), {"prompt_token_ids": [(i * 7919 + j) % 40000 + 100
                                                      for j in range(args.context)]}, params)
    while eng.scheduler.waiting or any(  # run until every sequence is decoding
            s.num_computed_tokens < len(s.all_token_ids) - 1
            for s in eng.scheduler.running):
        eng.step()
    for _ in range(3):
        eng.step()  # warm

    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    plain = (time.perf_counter() - t0) / args.steps
    print(f"{args.seqs} sequences, {args.dtype}, {torch.get_num_threads()} threads: "
          f"{plain * 1e3:.1f} ms per decode step, {args.seqs / plain:.0f} tok/s (no profiler)")

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            eng.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))

    cp = cProfile.Profile()
    cp.enable()
    for _ in range(args.steps):
        eng.step()
    cp.disable()
    by_file: dict[str, float] = defaultdict(float)
    for (file, _line, _fn), (_cc, _nc, tottime, _ct, _callers) in \
            pstats.Stats(cp).stats.items():  # type: ignore[attr-defined]
        by_file[file.split("/site-packages/")[-1].split("/wt/")[-1]] += tottime
    print("cProfile self time per step by file (ms):")
    for file, t in sorted(by_file.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {t / args.steps * 1e3:8.2f}  {file}")
    pstats.Stats(cp).sort_stats("tottime").print_stats(20)
    eng.close()
    return 0


def _prefill_round(eng, seqs: int, context: int, offset: int) -> int:  # noqa: ANN001
    """Add ``seqs`` distinct prompts and step until every one has sampled its first token;
    returns the number of steps. The sequences are aborted afterwards."""
    from kvscope.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for i in range(seqs):
        eng.add_request(f"p{offset}-{i}", {"prompt_token_ids": [
            (i * 7919 + j + offset) % 40000 + 100 for j in range(context)]}, params)
    steps = 0
    while eng.has_unfinished_requests():
        eng.step()
        steps += 1
    return steps


def _profile_prefill(eng, args) -> int:  # noqa: ANN001
    import torch
    from torch.profiler import ProfilerActivity, profile

    _prefill_round(eng, args.seqs, args.context, 1)  # warm
    t0 = time.perf_counter()
    steps = _prefill_round(eng, args.seqs, args.context, 2)
    plain = time.perf_counter() - t0
    tokens = args.seqs * args.context
    print(f"prefill of {args.seqs} x {args.context} tokens, {args.dtype}, "
          f"{torch.get_num_threads()} threads: {plain * 1e3:.0f} ms in {steps} steps, "
          f"{tokens / plain:.0f} prompt tok/s (no profiler)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _prefill_round(eng, args.seqs, args.context, 3)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
