"""`kvscope bench hybrid`: what the hybrid KV cache (engine.cache.window_group) saves, side by
side with keeping every block, in one run.

For each model shape (dummy configs: Gemma 3 1B, five windowed layers of W = 512 per
global one; Mistral 7B v0.1, every layer windowed, W = 4096), the cache managers themselves
run the workload (pure bookkeeping, no forward: the allocator decides capacity):

- bytes per sequence: one sequence prefilled to ``--context`` tokens in chunks of
  ``--chunk``, then decoding ``--decode`` tokens; its held blocks per group times the
  bytes of one block of that group's layers; and the bytes its swap preemption copies to
  the cpu tier (the hybrid cache: group 0's table and the window blocks it holds);
- concurrent sequences at one budget (``--budget-gib``): sequences of ``--context`` tokens
  admitted one after another (chunked prefill, then one decode token each) until the
  next does not fit; the hybrid pools are split as the engine splits them
  (engine.runner.kv_budget.hybrid_split, for sequences of ``--context`` tokens);
- the same with prefix caching on both sides, every prompt ``--context`` tokens of which
  all but the last ``--chunk`` are one shared prefix (a long system prompt or document):
  sequences admitted through ``match_prefix`` until the next does not fit, and the share
  of their prompt tokens served from the cache (the hybrid hit takes group 0's blocks of
  the prefix and the window group's blocks of its last W tokens).
"""

from __future__ import annotations

import argparse
import json
from types import SimpleNamespace
from typing import Any

SHAPES = ("gemma-3-1b", "mistral-7b")
# mistralai/Mistral-7B-v0.1's config.json: every layer windowed, W = 4096
MISTRAL_7B = {
    "model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
    "vocab_size": 32000, "sliding_window": 4096, "max_position_embeddings": 32768,
    "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("hybrid", help="hybrid KV cache vs keeping every block: bytes per "
                       "sequence and sequences per budget")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (tokens)")
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--budget-gib", type=float, default=4.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--json", action="store_true", help="print one JSON object only")
    p.set_defaults(func=run)


def model_config(shape: str):
    from kvscope.engine.model.config import config_from_hf
    from kvscope.engine.model.dummy import PRESETS

    cfg = MISTRAL_7B if shape == "mistral-7b" else PRESETS[shape]
    return config_from_hf(cfg, shape)


def _grow(m, sid: str, context: int, chunk: int, decode: int,
          prompt: list[int] | None = None) -> bool:
    """Prefill ``context`` tokens (``prompt``, or all 7s) in chunks after what
    ``match_prefix`` shares, then ``decode`` tokens; False when it does not fit (the
    sequence is dropped)."""
    m.add_sequence(sid, prompt if prompt is not None else [7] * context)
    done = m.match_prefix(sid)
    while done < context:
        n = min(chunk, context - done)
        if m.allocate_slots(sid, n) is None:
            m.finish(sid, "abort")
            return False
        done += n
    m.start(sid)
    for _ in range(decode):
        if m.allocate_slots(sid, 1) is None:
            m.finish(sid, "abort")
            return False
        m.append_token_ids(sid, [7])
    return True


def measure(shape: str, args: argparse.Namespace) -> dict[str, Any]:
    from kvscope.engine.cache import KVCacheManager
    from kvscope.engine.runner.kv_budget import hybrid_split

    mc = model_config(shape)
    bs = args.block_size
    windows = mc.layer_windows
    n_win = sum(w is not None for w in windows)
    n_full = len(windows) - n_win
    window = max(w for w in windows if w is not None)
    layer_block = 2 * bs * mc.num_kv_heads * mc.head_dim * 2  # K and V, bf16, one layer
    all_block = layer_block * len(windows)
    # one sequence
    big = -(-(args.context + args.decode) // bs) + 8
    keep = KVCacheManager(big, bs, enable_prefix_caching=False, num_cpu_blocks=big)
    hyb = KVCacheManager(big, bs, enable_prefix_caching=False, window=window,
                         num_window_blocks=big, num_cpu_blocks=big, num_window_cpu_blocks=big)
    assert _grow(keep, "s", args.context, args.chunk, args.decode)
    assert _grow(hyb, "s", args.context, args.chunk, args.decode)
    s = hyb.sequences["s"]
    held = hyb.window.held(s)
    keep_bytes = len(keep.sequences["s"].block_table) * all_block
    hyb_bytes = (len(s.block_table) * n_full + held * n_win) * layer_block
    assert keep.preempt("s", "swap") == hyb.preempt("s", "swap") == "swap"
    keep_swap = keep.host.copied_out_blocks * all_block
    hyb_swap = (hyb.host.copied_out_blocks * n_full
                + hyb.window_host.copied_out_blocks * n_win) * layer_block
    # sequences per budget
    budget = int(args.budget_gib * (1 << 30))
    num_blocks = budget // all_block
    keep = KVCacheManager(num_blocks, bs, enable_prefix_caching=False)
    config = SimpleNamespace(block_size=bs, max_num_seqs=1 << 20, num_gpu_blocks=None,
                             max_num_batched_tokens=args.chunk)
    num_full, num_window = hybrid_split(config, mc, num_blocks, args.context + args.decode)
    hyb = KVCacheManager(num_full, bs, enable_prefix_caching=False, window=window,
                         num_window_blocks=num_window)
    fits = {}
    for name, m in (("keep", keep), ("hybrid", hyb)):
        n = 0
        while _grow(m, f"s{n}", args.context, args.chunk, 1):
            n += 1
        fits[name] = n
    used = (num_full * n_full + num_window * n_win) * layer_block
    # the same budget, prefix caching on, prompts sharing all but their last chunk
    shared = [(5 * i) % 1000 for i in range(args.context - args.chunk)]
    keep = KVCacheManager(num_blocks, bs)
    hyb = KVCacheManager(num_full, bs, window=window, num_window_blocks=num_window)
    prefix = {}
    for name, m in (("keep", keep), ("hybrid", hyb)):
        n = 0
        while _grow(m, f"p{n}", args.context, args.chunk, 1,
                    shared + [1000 + n] * args.chunk):
            n += 1
        prefix[name] = (n, round(m.num_hit_tokens / max(m.num_query_tokens, 1), 3))
    return {
        "model": shape, "layers_full": n_full, "layers_window": n_win, "window": window,
        "context": args.context, "window_blocks_held": held, "keep_bytes_per_seq": keep_bytes,
        "hybrid_bytes_per_seq": hyb_bytes, "bytes_ratio": round(keep_bytes / hyb_bytes, 2),
        "keep_swap_bytes": keep_swap, "hybrid_swap_bytes": hyb_swap,
        "swap_ratio": round(keep_swap / hyb_swap, 2),
        "budget_gib": args.budget_gib, "hybrid_pools_bytes": used,
        "keep_seqs": fits["keep"], "hybrid_seqs": fits["hybrid"],
        "seqs_ratio": round(fits["hybrid"] / max(fits["keep"], 1), 2),
        "prefix_keep_seqs": prefix["keep"][0], "prefix_hybrid_seqs": prefix["hybrid"][0],
        "prefix_keep_hit_rate": prefix["keep"][1],
        "prefix_hybrid_hit_rate": prefix["hybrid"][1],
    }


def run(args: argparse.Namespace) -> int:
    rows = [measure(shape, args) for shape in SHAPES]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"context {args.context}, block size {args.block_size}, bf16 pages, budget "
          f"{args.budget_gib} GiB")
    print(f"{'model':<12} {'full:win':>8} {'W':>5} {'keep MiB/seq':>13} {'hybrid MiB/seq':>15} "
          f"{'x':>6} {'keep seqs':>10} {'hybrid seqs':>12} {'x':>6}")
    for r in rows:
        keep_mib, hyb_mib = r["keep_bytes_per_seq"] / 2**20, r["hybrid_bytes_per_seq"] / 2**20
        print(f"{r['model']:<12} {r['layers_full']:>3}:{r['layers_window']:<4} "
              f"{r['window']:>5} {keep_mib:>13.1f} {hyb_mib:>15.1f} {r['bytes_ratio']:>6.2f} "
              f"{r['keep_seqs']:>10} {r['hybrid_seqs']:>12} {r['seqs_ratio']:>6.2f}")
    print("one sequence's swap preemption, bytes copied to the cpu tier:")
    print(f"{'model':<12} {'keep MiB':>9} {'hybrid MiB':>11} {'x':>6}")
    for r in rows:
        print(f"{r['model']:<12} {r['keep_swap_bytes'] / 2**20:>9.1f} "
              f"{r['hybrid_swap_bytes'] / 2**20:>11.1f} {r['swap_ratio']:>6.2f}")
    print(f"prefix caching on, prompts sharing all but their last {args.chunk} tokens:")
    print(f"{'model':<12} {'keep seqs':>10} {'hybrid seqs':>12} {'keep hit':>9} "
          f"{'hybrid hit':>11}")
    for r in rows:
        print(f"{r['model']:<12} {r['prefix_keep_seqs']:>10} {r['prefix_hybrid_seqs']:>12} "
              f"{r['prefix_keep_hit_rate']:>9.3f} {r['prefix_hybrid_hit_rate']:>11.3f}")
    return 0
