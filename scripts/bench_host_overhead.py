"""The engine's host work per decode step: everything of ``LLMEngine.step`` except the forward
pass (scheduling, the cache manager, building the step's tensors, sampling, outputs), at
hundreds of running sequences. On a GPU this is time the device waits for (a batch-256
decode step of an 8B model is ~25 ms on an H100), so it is measured here with the forward
replaced by fixed logits (token 7 the likeliest): dummy:tiny shapes, CPU; greedy over its
512-token vocabulary, or tempered (0.8) over SmolLM2's 49,152 tokens.

This tree against an earlier commit (``--before``: its engine/ and kernels/ exported with
``git archive``), each in its own process, alternating rounds. ``output kind`` is how the
requests ask for outputs: ``cumulative`` (every step returns every running request's
output so far, as the server needs) or ``final`` (only finished ones, as ``LLM.generate``
asks since RequestOutputKind; an earlier commit without it runs cumulative). Prints the
table; nothing is asserted.

    .venv/bin/python scripts/bench_host_overhead.py [--before REF] [--seqs 64,256]
        [--tokens 16,1000] [--sampling greedy,tempered] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from before_tree import export_tree

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40  # timed steps per case


def worker(root: str, seqs: int, tokens: int, final: bool, tempered: bool) -> None:
    """Time STEPS decode steps after every sequence has ``tokens`` outputs; print JSON.
    ``tempered``: the requests sample at temperature 0.8 over SmolLM2's 49,152-token
    vocabulary (the draws are CPU work on any device); else greedy over dummy:tiny's 512."""
    sys.path.insert(0, root)
    import random

    import torch

    from kvscope.engine.config import EngineConfig
    from kvscope.engine.engine import LLMEngine
    from kvscope.engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    kind = {}
    if final:
        try:
            from kvscope.engine.sampling_params import RequestOutputKind
            kind = {"output_kind": RequestOutputKind.FINAL_ONLY}
        except ImportError:  # an earlier commit: cumulative is all it has
            kind = None
    blocks = seqs * ((120 + tokens + STEPS + 16) // 16 + 1)
    from kvscope.engine.model.dummy import PRESETS

    shapes = {**PRESETS["tiny"], "vocab_size": 49152 if tempered else 512}
    eng = LLMEngine(EngineConfig(model="tiny", load_format="dummy", hf_config=shapes,
                                 device="cpu", dtype="float32",
                                 num_gpu_blocks=blocks, max_num_seqs=seqs,
                                 max_num_batched_tokens=max(2048, seqs * 130),
                                 max_model_len=2048))
    vocab = eng.model_config.vocab_size

    made: dict[int, torch.Tensor] = {}

    def fixed_logits(batch, rows):
        n = batch.sample_index.shape[0]
        if n not in made:  # made once: allocating 256 x 49k floats is not the engine's cost
            made[n] = torch.randn(n, vocab, generator=torch.Generator().manual_seed(n))
            made[n][:, 7] += 5.0
        return made[n], None

    eng.runner.execute_keeping = fixed_logits
    params = SamplingParams(temperature=0.8 if tempered else 0.0,
                            max_tokens=tokens + STEPS + 8, ignore_eos=True, **(kind or {}))
    rng = random.Random(0)
    for i in range(seqs):
        eng.add_request(str(i), {"prompt_token_ids": [rng.randrange(3, vocab) for _ in
                                                      range(rng.randint(20, 120))]}, params)
    while any(len(s.output_token_ids) < tokens for s in eng.scheduler.running) or \
            len(eng.scheduler.running) < seqs:
        eng.step()
    times = []
    for _ in range(STEPS):
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
    print(json.dumps({"median_ms": statistics.median(times) * 1e3,
                      "min_ms": min(times) * 1e3, "cumulative": kind is None or not final}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", help="git ref whose engine/ and kernels/ to compare against")
    p.add_argument("--seqs", default="64,256")
    p.add_argument("--tokens", default="16,1000")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sampling", default="greedy,tempered")
    p.add_argument("--worker", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        root, seqs, tokens, final, sampling = args.worker
        worker(root, int(seqs), int(tokens), final == "final", sampling == "tempered")
        return 0

    roots = {"this tree": str(ROOT)}
    tmp = tempfile.TemporaryDirectory(prefix="kvscope-host-")
    if args.before:
        before = export_tree(args.before, Path(tmp.name) / "before", "engine", "kernels")
        roots = {f"before ({args.before})": str(before), **roots}
    cases = [(s, t, k, m) for m in args.sampling.split(",")
             for s in map(int, args.seqs.split(",")) for t in map(int, args.tokens.split(","))
             for k in ("cumulative", "final")]
    runs: dict[tuple, list[dict]] = {}
    for _ in range(args.rounds):
        for case in cases:
            for name, root in roots.items():
                out = subprocess.run([sys.executable, __file__, "--worker", root,
                                      *map(str, case)], capture_output=True, text=True,
                                     check=True, cwd=root)
                runs.setdefault((name, *case), []).append(
                    json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"host ms per decode step (forward replaced by fixed logits), median of {STEPS} "
          f"steps per round, {args.rounds} rounds")
    print("| code | sampling | sequences | tokens so far | output kind | ms (best round) | "
          "medians |")
    print("|---|---|---:|---:|---|---:|---|")
    for (name, seqs, tokens, kind, sampling), rs in runs.items():
        shown = kind if not rs[0]["cumulative"] or kind == "cumulative" else \
            "final (runs cumulative)"
        medians = " ".join(f"{r['median_ms']:.2f}" for r in rs)
        print(f"| {name} | {sampling} | {seqs} | {tokens} | {shown} | "
              f"{min(r['median_ms'] for r in rs):.2f} | {medians} |")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
