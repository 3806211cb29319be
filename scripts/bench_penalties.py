"""What sampling penalties cost (repetition/frequency/presence, engine.sampling_ops): the
decode step of a batch whose rows all carry penalties against the same batch without, on the
embedded model (SmolLM2, CPU), greedy, side by side in one process, alternating rounds, best
round. Prints the numbers; nothing is asserted.

    .venv/bin/python scripts/bench_penalties.py [--rows 4,32] [--rounds 3] [--tokens 40]
"""

from __future__ import annotations

import argparse
import time

PROMPT = "Write a short story about a lighthouse keeper:\n"
VARIANTS = {"none": {}, "repetition 1.3": {"repetition_penalty": 1.3},
            "all three": {"repetition_penalty": 1.1, "frequency_penalty": 0.5,
                          "presence_penalty": 0.5}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="4,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=40)
    args = ap.parse_args()

    from kvscope.engine.llm import LLM
    from kvscope.engine.sampling_params import SamplingParams

    llm = LLM("smollm2")
    for rows in (int(r) for r in args.rows.split(",")):
        best = dict.fromkeys(VARIANTS, float("inf"))
        for _ in range(args.rounds):
            for label, kw in VARIANTS.items():
                params = SamplingParams(temperature=0.0, max_tokens=args.tokens,
                                        ignore_eos=True, **kw)
                t0 = time.perf_counter()
                outs = llm.generate([PROMPT] * rows, params, use_tqdm=False)
                steps = max(len(o.outputs[0].token_ids) for o in outs)
                best[label] = min(best[label], (time.perf_counter() - t0) / steps)
        base = best["none"]
        print(f"{rows} rows: " + ", ".join(
            f"{k} {v * 1e3:.2f} ms/step ({(v / base - 1) * 100:+.1f}%)" for k, v in best.items()))


if __name__ == "__main__":
    main()
