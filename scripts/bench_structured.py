"""What structured outputs cost (engine.structured): the grammar mask per token, and the
decode step of a batch whose rows all follow a JSON schema against the same batch
unconstrained, on the embedded model (SmolLM2, CPU), side by side in one process,
alternating rounds, best round. And why JSON comes out compact (``JSON_LAYOUT``): how many
of 8 seeded tool-call answers at temperature 1 finish within 80 tokens with the compact
layout and with free whitespace. Prints the numbers; nothing is asserted.

    .venv/bin/python scripts/bench_structured.py [--rows 4,32] [--rounds 3] [--tokens 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

SCHEMA = {"type": "object", "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
PROMPT = "Describe a person as JSON with a name, an age and tags:\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="4,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=40)
    args = ap.parse_args()

    from kvscope.engine.llm import LLM
    from kvscope.engine.sampling_params import SamplingParams
    from kvscope.engine.structured import GrammarMatcher, StructuredOutputsParams

    llm = LLM("smollm2")
    tok = llm.tokenizer
    constraint = StructuredOutputsParams(json=SCHEMA)
    t0 = time.perf_counter()
    matcher = GrammarMatcher(constraint, tok)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    GrammarMatcher(constraint, tok)
    again = time.perf_counter() - t0
    masks = []
    for token in tok.encode('{"name": "Alice Smith", "age": 42, "tags": ["a", "bb", "ccc"]}',
                            add_special_tokens=False):
        t0 = time.perf_counter()
        matcher.allowed(llm.config.vocab_size)
        masks.append(time.perf_counter() - t0)
        matcher.accept(token)
    print(f"matcher: first {first * 1e3:.0f} ms (builds the tokenizer's index), then "
          f"{again * 1e3:.1f} ms; mask per token: median {statistics.median(masks) * 1e6:.0f} "
          f"us, max {max(masks) * 1e6:.0f} us over {len(masks)} tokens")
    import kvscope.engine.structured as structured
    from kvscope.engine.server.tools import constraint as tool_constraint

    weather = [{"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    compact = structured.JSON_LAYOUT
    for label, layout in (("compact", compact), ("free whitespace", {})):
        structured.JSON_LAYOUT = layout
        outs = [llm.chat([{"role": "user", "content": "Weather in Rome?"}], SamplingParams(
            temperature=1.0, seed=seed, max_tokens=80,
            structured_outputs=tool_constraint(weather, "required")), use_tqdm=False)[0]
            .outputs[0] for seed in range(8)]
        print(f"tool call, {label}: {sum(o.finish_reason == 'stop' for o in outs)}/8 finished "
              f"within 80 tokens; tokens {[len(o.token_ids) for o in outs]}")
    structured.JSON_LAYOUT = compact
    for rows in (int(r) for r in args.rows.split(",")):
        best = {"unconstrained": float("inf"), "json schema": float("inf")}
        for _ in range(args.rounds):
            for label in best:
                params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True,
                                        structured_outputs=constraint
                                        if label == "json schema" else None)
                t0 = time.perf_counter()
                outs = llm.generate([PROMPT] * rows, params, use_tqdm=False)
                steps = max(len(o.outputs[0].token_ids) for o in outs)
                best[label] = min(best[label], (time.perf_counter() - t0) / steps)
        base = best["unconstrained"]
        print(f"{rows} rows: " + ", ".join(f"{k} {v * 1e3:.2f} ms/step" for k, v in best.items())
              + f" ({(best['json schema'] / base - 1) * 100:+.1f}%)")


if __name__ == "__main__":
    main()
