"""`kvscope bench quant`: what quantized KV pages buy (capacity) and cost (accuracy).

For each kv_cache_dtype (auto, fp8, int8, int4) on the default model:

- capacity: blocks and tokens that fit in one byte budget (``--budget-mib``), and the
  ratio to 16-bit pages (fp16/bf16, what "auto" is on a GPU; on CPU "auto" is fp32, whose
  numbers are reported too as ``auto_fp32_*``).
- accuracy, teacher-forced on a real English text already on the machine (default:
  Debian's /usr/share/common-licenses/GPL-3, first ``--tokens`` tokens): the text runs
  through the paged engine's ModelRunner in ``--chunk``-token chunks (chunked prefill), so
  every chunk after the first attends over context read back from quantized pages. Against
  the same run on unquantized (auto) pages: perplexity and its ratio, mean KL(auto || fmt)
  of the next-token distributions, top-1 agreement.
- ``--bf16-reference``: the same teacher-forced scores for bf16 pages (what "auto" is on a
  GPU) against the fp32 pages of the CPU run, as ``bf16_pages``: how far 16-bit pages
  alone already move these metrics (top-1 flips at near-ties in particular).
- the same teacher-forced scores on a second text of another kind, code (``--code-text``,
  default: the standard library's ``argparse.py``), as ``code_*`` keys per format.
- greedy generation through LLMEngine on the engine's invariance prompts: tokens generated
  before the first divergence from auto, per prompt (``greedy_agree_tokens`` is the mean,
  out of ``--max-tokens``).

All formats advance chunk by chunk in lockstep, so no full-text logits are kept.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from kvscope.engine.events import formats

DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"
DTYPES = formats.KV_CACHE_DTYPES  # the registry's (engine.events.formats)
# The prompts of tests/engine/test_invariance.py.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "List three colours of the rainbow:",
    "In 1969, the first humans",
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quant", help="quantized KV pages: capacity and accuracy per dtype")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--text", default=DEFAULT_TEXT, help="English text for teacher forcing")
    p.add_argument("--code-text", default=None,
                   help="a second text, code (default: the standard library's argparse.py)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the text to score")
    p.add_argument("--chunk", type=int, default=256, help="chunked-prefill size")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--budget-mib", type=int, default=1024, help="KV budget for capacity")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="comma list; auto is added")
    p.add_argument("--bf16-reference", action="store_true",
                   help="also score bf16 pages against fp32 pages (no greedy run)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true", help="print one JSON object only")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvscope.engine.model import load_model

    torch.set_num_threads(args.threads)
    dtypes = ["auto"] + [d for d in args.dtypes.split(",") if d and d != "auto"]
    model, tokenizer, cfg = load_model(args.model, device="cpu", dtype=torch.float32)
    text_path = Path(args.text)
    ids = tokenizer.encode(text_path.read_text())[: args.tokens]
    if len(ids) < 2:
        raise SystemExit(f"{text_path} gave {len(ids)} tokens; need at least 2")
    t0 = time.perf_counter()
    result: dict[str, Any] = {"text": str(text_path), "tokens": len(ids), "chunk": args.chunk,
                              "block_size": args.block_size, "budget_mib": args.budget_mib}
    capacity = capacity_table(dtypes, cfg, args.block_size, args.budget_mib << 20)
    scored = dtypes + (["bf16"] if args.bf16_reference else [])
    accuracy = teacher_forced(model, cfg, ids, scored, args.chunk, args.block_size)
    code_path = Path(args.code_text or _stdlib_source())
    code_ids = tokenizer.encode(code_path.read_text())[: args.tokens]
    code = teacher_forced(model, cfg, code_ids, dtypes, args.chunk, args.block_size)
    result["code_text"], result["code_tokens"] = str(code_path), len(code_ids)
    greedy = greedy_agreement((model, tokenizer, cfg), dtypes, args.max_tokens,
                              args.block_size)
    for d in dtypes:
        result[d] = {**capacity[d], **accuracy[d], **greedy[d],
                     **{f"code_{k}": v for k, v in code[d].items()}}
    if args.bf16_reference:
        result["bf16_pages"] = accuracy["bf16"]
    result["seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
    return 0


def capacity_table(dtypes: list[str], cfg, block_size: int, budget: int) -> dict[str, dict]:
    import torch

    from kvscope.engine.runner.page_format import page_format

    base = page_format("auto", torch.float16, cfg, block_size)
    fp32 = page_format("auto", torch.float32, cfg, block_size)
    out = {}
    for d in dtypes:
        fmt = page_format(d, torch.float16, cfg, block_size)  # auto: 16-bit pages
        blocks = fmt.num_blocks(budget)
        row = {
            "format": fmt.name, "bytes_per_block": fmt.bytes_per_block,
            "bytes_per_token_head": fmt.bytes_per_token_head, "blocks": blocks,
            "capacity_tokens": blocks * block_size,
            "capacity_ratio": round(blocks / base.num_blocks(budget), 3),
        }
        if d == "auto":
            row["auto_fp32_blocks"] = fp32.num_blocks(budget)
            row["auto_fp32_ratio"] = round(fp32.num_blocks(budget) / base.num_blocks(budget), 3)
        out[d] = row
    return out


def teacher_forced(model, cfg, ids: list[int], dtypes: list[str], chunk: int,
                   block_size: int) -> dict[str, dict]:
    """Score ``ids`` with every page format in lockstep, chunk by chunk."""
    import torch
    import torch.nn.functional as F

    from kvscope.engine.runner.kv_budget import spec_of
    from kvscope.engine.runner.model_runner import ModelRunner, StepBatch

    n = len(ids)
    num_blocks = (n + block_size - 1) // block_size
    def runner(d: str) -> ModelRunner:  # "bf16": unquantized bf16 pages under the fp32 model
        page_dtype = torch.bfloat16 if d == "bf16" else torch.float32
        spec = spec_of("auto" if d == "bf16" else d, page_dtype, cfg, block_size, num_blocks)
        return ModelRunner(model, cfg, spec, torch.device("cpu"))

    runners = {d: runner(d) for d in dtypes}
    tokens = torch.tensor(ids, dtype=torch.int64)
    table = torch.arange(num_blocks, dtype=torch.int32)[None, :]  # one sequence, in order
    nll = dict.fromkeys(dtypes, 0.0)
    kl = dict.fromkeys(dtypes, 0.0)
    agree = dict.fromkeys(dtypes, 0)
    scored = 0
    for lo in range(0, n - 1, chunk):
        hi = min(n, lo + chunk)
        rows = hi - lo
        batch = StepBatch(
            input_ids=tokens[lo:hi], positions=torch.arange(lo, hi),
            slot_mapping=torch.arange(lo, hi),  # block i holds positions i*bs..: slot = pos
            block_tables=table, seq_lens=torch.tensor([hi], dtype=torch.int32),
            cu_seqlens_q=torch.tensor([0, rows], dtype=torch.int32),
            sample_index=torch.arange(rows))
        targets = tokens[lo + 1:hi + 1]
        m = targets.numel()  # the text's last token has no next token to score
        ref = None
        for d in dtypes:
            logp = F.log_softmax(runners[d].execute(batch)[:m], dim=-1)
            nll[d] += float(-logp.gather(1, targets[:, None]).sum())
            if ref is None:
                ref = logp
            kl[d] += float((ref.exp() * (ref - logp)).sum())
            agree[d] += int((logp.argmax(-1) == ref.argmax(-1)).sum())
        scored += m
        print(f"bench quant: scored {scored}/{n - 1} tokens", file=sys.stderr, flush=True)
    base_ppl = math.exp(nll["auto"] / scored)
    out = {}
    for d in dtypes:
        ppl = math.exp(nll[d] / scored)
        out[d] = {"ppl": round(ppl, 4), "ppl_ratio": round(ppl / base_ppl, 5),
                  "kl_mean": round(kl[d] / scored, 6),
                  "top1_agreement": round(agree[d] / scored, 5)}
    return out


def greedy_agreement(loaded, dtypes: list[str], max_tokens: int,
                     block_size: int) -> dict[str, dict]:
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.engine import LLMEngine
    from kvscope.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}
    for d in dtypes:
        eng = LLMEngine(EngineConfig(kv_cache_dtype=d, block_size=block_size,
                                     num_gpu_blocks=64 * len(PROMPTS)), loaded=loaded)
        try:
            for i, p in enumerate(PROMPTS):
                eng.add_request(str(i), p, params)
            done: dict[str, list[int]] = {}
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished:
                        done[o.request_id] = list(o.outputs[0].token_ids)
            outputs[d] = [done[str(i)] for i in range(len(PROMPTS))]
            print(f"bench quant: greedy {d} done", file=sys.stderr, flush=True)
        finally:
            eng.close()
    out = {}
    for d in dtypes:
        per_prompt = [_common_prefix(a, b) for a, b in zip(outputs["auto"], outputs[d],
                                                            strict=True)]
        out[d] = {"greedy_agree_tokens": round(sum(per_prompt) / len(per_prompt), 2),
                  "greedy_agree_per_prompt": per_prompt, "greedy_max_tokens": max_tokens}
    return out


def _stdlib_source() -> str:
    """A Python file of the standard library: code, whose exact tokens matter."""
    import argparse as stdlib_module

    return stdlib_module.__file__


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
