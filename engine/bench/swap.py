"""`kvscope bench swap`: the cpu tier's transfer speed and what a host prefix hit saves.

1. bandwidth: ``Swapper`` moving ``--swap-blocks`` scattered blocks of ``--model``'s pages
   (SmolLM2 by default: 30 layers, 3 KV heads, head_dim 64; ``--block-size`` tokens; fp16
   on a GPU, fp32 on CPU) out to the host tier and back in, one batched round (one
   ``kernels.swap_blocks`` per cache tensor and direction), against a plain ``copy_`` of
   the same number of bytes between one contiguous device tensor and one (pinned, on GPU)
   host tensor. Best of ``--repeat``; GB/s = 1e9 bytes/s.
2. time to first token of a request whose ``--prefix-tokens``-token prefix (random token
   ids, deterministic) was computed by an earlier request and then evicted from the device:
   served from the host tier (write-back on eviction, host hit, copy in) vs recomputed (no
   host tier), and, for reference, with the prefix still cached on the device. Each is the
   best of ``--repeat`` fresh engines sharing one loaded model.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("swap", help="cpu swap tier: transfer bandwidth, TTFT of host hits")
    p.add_argument("--device", default="auto")
    p.add_argument("--model", default="smollm2",
                   help="whose page shapes and forward (dummy:llama-3-8b: random weights of "
                        "Llama-3-8B's shapes)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--pool-blocks", type=int, default=None,
                   help="device pool blocks for the bandwidth test (default: 4096 on GPU, "
                        "256 on CPU)")
    p.add_argument("--swap-blocks", type=int, default=None,
                   help="blocks moved per round (default: pool / 2)")
    p.add_argument("--prefix-tokens", type=int, default=None,
                   help="shared prefix length for TTFT (default: 2048 on GPU, 512 on CPU)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--skip-ttft", action="store_true", help="bandwidth only (no model)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bandwidth(device, block_size: int, pool_blocks: int, swap_blocks: int,
              repeat: int, model: str = "smollm2") -> dict[str, Any]:
    import torch

    from kvscope.engine.model.loader import read_config
    from kvscope.engine.runner.page_format import page_format
    from kvscope.engine.runner.swapper import Swapper

    dtype = torch.float16 if device.type == "cuda" else torch.float32
    fmt = page_format("auto", dtype, read_config(model)[1], block_size)
    pages = fmt.allocate(pool_blocks, device)
    tensors = pages.per_block_tensors
    for t in tensors:
        t.normal_()
    swapper = Swapper(tensors, pool_blocks)
    gen = torch.Generator().manual_seed(0)
    src = torch.randperm(pool_blocks, generator=gen)[:swap_blocks].tolist()
    dst = torch.randperm(pool_blocks, generator=gen)[:swap_blocks].tolist()
    nbytes = swap_blocks * swapper.bytes_per_block

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(repeat + 1):  # the first run warms up allocators and pinned pools
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        return best

    t_out = timed(lambda: swapper.execute([(list(zip(src, dst, strict=True)), [])]))
    t_in = timed(lambda: swapper.execute([([], list(zip(dst, src, strict=True)))]))
    # The same data must have made the round trip.
    for t, h in zip(tensors, swapper.host_tensors, strict=True):
        assert torch.equal(t[src].cpu(), h[dst])
    flat_dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    t_copy_out = timed(lambda: flat_host.copy_(flat_dev, non_blocking=True))
    t_copy_in = timed(lambda: flat_dev.copy_(flat_host, non_blocking=True))
    gb = nbytes / 1e9
    return {
        "bytes_per_block": swapper.bytes_per_block, "swap_blocks": swap_blocks,
        "pool_blocks": pool_blocks, "bytes": nbytes, "dtype": str(dtype).split(".")[-1],
        "swap_out_gb_s": gb / t_out, "swap_in_gb_s": gb / t_in,
        "copy_out_gb_s": gb / t_copy_out, "copy_in_gb_s": gb / t_copy_in,
        "swap_out_vs_copy": t_copy_out / t_out, "swap_in_vs_copy": t_copy_in / t_in,
        "swap_out_ms": t_out * 1e3, "swap_in_ms": t_in * 1e3,
    }


def ttft(device_name: str, block_size: int, prefix_tokens: int, repeat: int,
         model: str = "smollm2") -> dict[str, Any]:
    import random

    from kvscope.engine.config import EngineConfig
    from kvscope.engine.device import resolve_device, resolve_dtype
    from kvscope.engine.engine import LLMEngine
    from kvscope.engine.model import load_model
    from kvscope.engine.runner.page_format import page_format
    from kvscope.engine.sampling_params import SamplingParams

    device = resolve_device(device_name)
    dtype = resolve_dtype("auto", device)
    loaded = load_model(model, device=device, dtype=dtype)
    vocab = loaded[2].vocab_size
    rng = random.Random(0)
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_tokens)]
    first = prefix + [rng.randrange(3, vocab) for _ in range(8)]
    second = prefix + [rng.randrange(3, vocab) for _ in range(8)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    blocks = 2 * -(-(prefix_tokens + 16) // block_size) + 8
    per_block = page_format("auto", dtype, loaded[2], block_size).bytes_per_block

    def measure(host: bool, evict: bool) -> tuple[float, dict[str, Any]]:
        best, stats = float("inf"), {}
        for _ in range(repeat):
            # as many host blocks as device blocks: room for the whole prefix
            swap = (blocks + 0.5) * per_block / (1 << 30) if host else 0.0
            cfg = EngineConfig(model=model, device=device_name, dtype=dtype,
                               block_size=block_size, num_gpu_blocks=blocks,
                               max_num_batched_tokens=max(2048, prefix_tokens + 16),
                               swap_space=swap)
            eng = LLMEngine(cfg, loaded=loaded)
            eng.add_request("first", {"prompt_token_ids": first}, one)
            while eng.has_unfinished_requests():
                eng.step()
            if evict:
                eng.cache.evict_cached()
            _sync(eng.device)
            t0 = time.perf_counter()
            eng.add_request("second", {"prompt_token_ids": second}, one)
            while eng.has_unfinished_requests():
                eng.step()
            _sync(eng.device)
            dt = time.perf_counter() - t0
            if dt < best:
                m = eng.cache.metrics()
                best, stats = dt, {"hit_tokens": m["prefix_hit_tokens"],
                                   "host_hit_tokens": m["host_hit_tokens"]}
            eng.close()
        return best, stats

    host_s, host_stats = measure(host=True, evict=True)
    recompute_s, rec_stats = measure(host=False, evict=True)
    gpu_s, _ = measure(host=False, evict=False)
    return {
        "prefix_tokens": prefix_tokens,
        "ttft_host_hit_s": host_s, "ttft_recompute_s": recompute_s, "ttft_device_hit_s": gpu_s,
        "host_hit_speedup": recompute_s / host_s,
        "host_hit_tokens": host_stats["host_hit_tokens"],
        "recompute_hit_tokens": rec_stats["hit_tokens"],
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from kvscope.engine.device import resolve_device

    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    cuda = device.type == "cuda"
    pool = args.pool_blocks or (4096 if cuda else 256)
    swap = args.swap_blocks or pool // 2
    if not 1 <= swap <= pool:
        raise SystemExit(f"--swap-blocks must be in [1, {pool}], got {swap}")
    result: dict[str, Any] = {"device": str(device), "block_size": args.block_size,
                              "model": args.model}
    if cuda:
        result["gpu"] = torch.cuda.get_device_name(device)
    result.update(bandwidth(device, args.block_size, pool, swap, args.repeat, args.model))
    if not args.skip_ttft:
        prefix = args.prefix_tokens or (2048 if cuda else 512)
        result.update(ttft(args.device, args.block_size, prefix, args.repeat, args.model))
    if args.json:
        print(json.dumps(result))
        return 0
    for k, v in result.items():
        print(f"{k:>24}: {v:.4g}" if isinstance(v, float) else f"{k:>24}: {v}")
    return 0
