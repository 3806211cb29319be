"""Where an offline CPU batch spends its time, prefill and decode together: 32 distinct
token-id prompts (20..349 tokens, mean 181.5) x 64 greedy tokens through ``LLM.generate``,
one warm-up run, one timed run (wall and process CPU time), one run under torch.profiler
(op self time). Prints the numbers and the table; nothing is asserted. With ``--threads 1``
the CPU time is steady even on a shared box (no OpenMP waits to inflate it).

    .venv/bin/python scripts/profile_cpu_offline.py [--dtype bfloat16] [--threads 1]
"""

from __future__ import annotations

import argparse
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", type=int, default=14, help="ops in the profile table")
    args = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvscope.engine import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM("smollm2", device="cpu", dtype=args.dtype)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = [{"prompt_token_ids": [(i * 7919 + j) % 40000 + 100
                                     for j in range(20 + (i * 53) % 330)]} for i in range(32)]

    def run() -> tuple[float, float]:
        llm.llm_engine.cache.evict_cached()  # every run prefills every prompt (no hits)
        t0, c0 = time.perf_counter(), time.process_time()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0, time.process_time() - c0

    run()
    wall, cpu = run()
    tokens = 32 * 64
    print(f"{args.dtype}, {torch.get_num_threads()} threads: wall {wall:.2f} s ({tokens / wall:.0f}"
          f" tok/s), process CPU {cpu:.2f} s ({tokens / cpu:.0f} tok per CPU-second)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))
    llm.llm_engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
