"""The native CPU prefill attention (kernels/cpu_paged_prefill.c) against torch's flash SDPA
in float32 (the engine's previous prefill path) on one fresh prompt at SmolLM2's shapes
(9 q / 3 kv heads of 64, pages of 16): median of 15 calls each, interleaved per length.
Prints the table; nothing is asserted.

    .venv/bin/python scripts/bench_cpu_prefill.py [--threads 2] [--lengths 100,200,350]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lengths", default="100,200,350")
    args = p.parse_args()

    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    from kvscope.kernels import cpu_native
    from tests.kernels.oracle import make_batch

    torch.set_num_threads(args.threads)
    hq, hkv, d, bs = 9, 3, 64, 16

    def median_us(fn) -> float:
        fn(), fn()
        times = []
        for _ in range(15):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return statistics.median(times) * 1e6

    print(f"threads {args.threads}; GFLOPS count the causal half (2 * 2 * Hq * D * L^2 / 2)")
    print("| tokens | dtype | native us | GFLOPS | torch SDPA (float32) us | GFLOPS | speed-up |")
    print("|---|---|---|---|---|---|---|")
    for length in map(int, args.lengths.split(",")):
        for dtype in (torch.float32, torch.bfloat16):
            b = make_batch([length], [length], hq, hkv, d, bs, dtype=dtype, seed=1)
            if not cpu_native.supports_prefill(b.q, b.k_cache, b.v_cache):
                print(f"| {length} | {dtype} | not supported on this CPU/build |")
                continue
            spans = torch.tensor([[0], [length], [length]])
            tables = b.block_tables.long().contiguous()
            out = torch.empty(b.q.shape, dtype=dtype)
            native = median_us(lambda: cpu_native.paged_prefill(  # noqa: B023
                b.q, b.k_cache, b.v_cache, tables, spans, d ** -0.5, out))  # noqa: B023
            k = b.keys[0].float().transpose(0, 1)[None]
            v = b.values[0].float().transpose(0, 1)[None]
            q = b.q.float().transpose(0, 1)[None]
            sdpa = median_us(lambda: F.scaled_dot_product_attention(  # noqa: B023
                q, k, v, is_causal=True, enable_gqa=True))  # noqa: B023
            flops = 2 * 2 * hq * d * length * length / 2
            print(f"| {length} | {str(dtype).removeprefix('torch.')} | {native:.0f} | "
                  f"{flops / native / 1e3:.0f} | {sdpa:.0f} | {flops / sdpa / 1e3:.0f} | "
                  f"{sdpa / native:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
