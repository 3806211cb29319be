"""`kvscope generate PROMPT...`: answer prompts with the model (chat template by default)."""

from __future__ import annotations

import argparse


def _generate(args: argparse.Namespace) -> int:
    import time

    import torch

    from kvscope.engine.model.errors import ModelLoadError

    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        from kvscope.engine import LLM, SamplingParams

        start = time.perf_counter()
        llm = LLM(model=args.model, device=args.device, dtype=args.dtype, seed=args.seed,
                  load_format=args.load_format, enforce_eager=args.enforce_eager)
        load_s = time.perf_counter() - start
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                ignore_eos=args.ignore_eos,
                                repetition_penalty=args.repetition_penalty)
    except (ModelLoadError, ValueError) as exc:
        print(f"kvscope generate: {exc}")
        return 1
    start = time.perf_counter()
    try:
        if args.prompt_token_ids:
            prompts = [{"prompt_token_ids": [int(t) for t in p.split(",")]}
                       for p in args.prompts]
            outputs = llm.generate(prompts, params, use_tqdm=False)
        elif args.raw:
            outputs = llm.generate(args.prompts, params, use_tqdm=False)
        else:
            conversations = [[{"role": "user", "content": p}] for p in args.prompts]
            outputs = llm.chat(conversations, params, use_tqdm=False)
    except ValueError as exc:  # e.g. text for a model without a tokenizer (dummy:...)
        hint = " (pass --prompt-token-ids 1,2,3)" if llm.tokenizer is None else ""
        print(f"kvscope generate: {exc}{hint}")
        return 1
    gen_s = time.perf_counter() - start
    for prompt, out in zip(args.prompts, outputs, strict=True):
        if len(args.prompts) > 1:
            print(f"> {prompt}")
        if llm.tokenizer is None:  # no text to show: the ids
            print(",".join(map(str, out.outputs[0].token_ids)))
        else:
            print(out.outputs[0].text.strip())
        if len(args.prompts) > 1:
            print()
    if args.stats:
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
        new_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        print(f"[stats] load {load_s:.1f} s; {len(outputs)} prompt(s), {prompt_tokens} prompt "
              f"tokens, {new_tokens} generated in {gen_s:.1f} s = {new_tokens / gen_s:.1f} tok/s "
              f"(one sequence at a time, {torch.get_num_threads()} torch thread(s), "
              f"{llm.device}, {llm.dtype})")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate answers to prompts and print them")
    p.add_argument("prompts", nargs="+", metavar="PROMPT")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2', a .gguf file, an HF dir, or dummy:<preset> (random weights "
                        "of real shapes: dummy:smollm2-135m, dummy:llama-3-8b; no tokenizer)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="dummy: random weights of --model's shapes (vLLM's name)")
    p.add_argument("--prompt-token-ids", action="store_true",
                   help="each PROMPT is comma-separated token ids (no tokenizer needed); "
                        "prints the generated ids")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="vLLM's: > 1 discourages every token of the prompt and the answer "
                        "so far (1: off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw", action="store_true", help="no chat template: continue the text")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: default)")
    p.add_argument("--stats", action="store_true", help="print load time and tokens/s")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="run the model eagerly; default: CUDA decode steps replay CUDA "
                        "graphs, CPU runs eagerly. --no-enforce-eager: also torch.compile "
                        "the CPU decode forward (engine.runner.compiled)")
    p.set_defaults(func=_generate)
