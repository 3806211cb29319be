"""Benchmark the paged-attention kernels.

GPU mode (default; refuses without CUDA): decode attention bandwidth = K/V bytes read / time,
as a fraction of the device's measured device-to-device copy bandwidth (read + write bytes
of a 2 GiB tensor copy), Llama-8B-like shapes (32 q heads, 8 KV heads, head_dim 128, fp16,
block 16) over batch {1, 8, 32, 128} x context {1k, 4k, 16k}. Side by side in one run: the
Triton paged kernel, torch SDPA on a contiguous [B, Hkv, L, D] cache (enable_gqa, no
repeat), and the torch reference on the GPU. Timing: triton.testing.do_bench (CUDA events,
L2 flushed). Writes JSON and a PNG chart.

    python scripts/bench_kernels.py [--out-dir build/bench_kernels]

CPU mode: the torch reference (the engine's CPU attention path) against a naive loop over
sequences, at the default model's shapes (9 q heads, 3 KV heads, head_dim 64, block 16).

    python scripts/bench_kernels.py --cpu-reference
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvscope import kernels  # noqa: E402
from kvscope.kernels import reference  # noqa: E402

BATCHES = (1, 8, 32, 128)
CONTEXTS = (1024, 4096, 16384)
HQ, HKV, HEAD_DIM, BLOCK = 32, 8, 128, 16


# ---------------------------------------------------------------- shared
def paged_decode_batch(batch: int, context: int, hq: int, hkv: int, head_dim: int, block: int,
                       dtype: torch.dtype, device: str, seed: int = 0) -> dict:
    """Every sequence ``context`` tokens long, its pages a random permutation of the pool."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    pages_per_seq = math.ceil(context / block)
    num_blocks = batch * pages_per_seq
    k_cache = torch.randn(num_blocks, block, hkv, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn(num_blocks, block, hkv, head_dim, dtype=dtype, device=device)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, pages_per_seq)
    return dict(
        q=torch.randn(batch, hq, head_dim, dtype=dtype, device=device),
        k_cache=k_cache, v_cache=v_cache,
        block_tables=tables.to(device=device, dtype=torch.int32),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device=device),
    )


def attention_args(b: dict, scale: float) -> tuple:
    return (b["q"], b["k_cache"], b["v_cache"], b["block_tables"], b["seq_lens"],
            b["cu_seqlens_q"], scale)


# ---------------------------------------------------------------- GPU mode
def copy_bandwidth(do_bench) -> float:
    """Bytes/s of a device-to-device copy, counting the read and the write."""
    size = 2 << 30
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * size / (ms * 1e-3)


def bench_config(batch: int, context: int, copy_bw: float, do_bench) -> dict:
    """One (batch, context) point: Triton paged, SDPA on a contiguous cache, torch reference."""
    import torch.nn.functional as F

    kv_bytes = 2 * batch * context * HKV * HEAD_DIM * 2  # K and V, fp16
    row = dict(batch=batch, context=context, kv_bytes=kv_bytes)
    if 3.2 * kv_bytes > torch.cuda.mem_get_info()[0]:  # paged + contiguous + reference gather
        row["skipped"] = "not enough GPU memory"
        return row
    scale = HEAD_DIM ** -0.5
    b = paged_decode_batch(batch, context, HQ, HKV, HEAD_DIM, BLOCK, torch.float16, "cuda")
    args = attention_args(b, scale)
    out = torch.empty_like(b["q"])
    # The contiguous cache holds the same keys in sequence order: [B, Hkv, L, D].
    pages = b["block_tables"].long()
    k_dense = b["k_cache"][pages].flatten(1, 2).transpose(1, 2).contiguous()
    v_dense = b["v_cache"][pages].flatten(1, 2).transpose(1, 2).contiguous()
    q4 = b["q"][:, :, None, :]

    def triton_fn():
        return kernels.paged_attention(*args, out=out)

    def sdpa_fn():
        return F.scaled_dot_product_attention(q4, k_dense, v_dense, scale=scale,
                                              enable_gqa=True)

    def reference_fn():
        with kernels.force_backend("reference"):
            return kernels.paged_attention(*args)

    got, want = triton_fn().float(), sdpa_fn()[:, :, 0].float()
    row["max_abs_diff_vs_sdpa"] = float((got - want).abs().max())
    for name, fn in (("triton_paged", triton_fn), ("sdpa_contiguous", sdpa_fn),
                     ("torch_reference", reference_fn)):
        try:
            ms = do_bench(fn)
            row[name] = dict(ms=ms, bw_fraction=kv_bytes / (ms * 1e-3) / copy_bw)
        except torch.cuda.OutOfMemoryError:
            row[name] = None
    return row


def bench_gpu(out_dir: Path) -> int:
    if not torch.cuda.is_available():
        print("bench_kernels.py measures GPU kernels and needs CUDA; none is available here.\n"
              "On CPU run: python scripts/bench_kernels.py --cpu-reference", file=sys.stderr)
        return 2
    from triton.testing import do_bench

    device_name = torch.cuda.get_device_name()
    copy_bw = copy_bandwidth(do_bench)
    torch.cuda.empty_cache()
    print(f"{device_name}: device-to-device copy {copy_bw / 1e12:.2f} TB/s")
    rows = []
    for batch in BATCHES:
        for context in CONTEXTS:
            rows.append(bench_config(batch, context, copy_bw, do_bench))
            torch.cuda.empty_cache()
            print(_row_text(rows[-1]))
    result = dict(date=str(date.today()), device=device_name, torch=torch.__version__,
                  copy_bandwidth_bytes_per_s=copy_bw,
                  shapes=dict(q_heads=HQ, kv_heads=HKV, head_dim=HEAD_DIM, block_size=BLOCK,
                              dtype="float16"), rows=rows)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "decode_bandwidth.json").write_text(json.dumps(result, indent=2))
    _chart(result, out_dir / "decode_bandwidth.png")
    print(f"wrote {out_dir / 'decode_bandwidth.json'} and decode_bandwidth.png")
    return 0


def _row_text(row: dict) -> str:
    cells = [f"B={row['batch']:<4} ctx={row['context']:<6}"]
    if "skipped" in row:
        return f"{cells[0]}  skipped: {row['skipped']}"
    for name in ("triton_paged", "sdpa_contiguous", "torch_reference"):
        r = row.get(name)
        cells.append(f"{name} {r['ms']:8.3f} ms {100 * r['bw_fraction']:5.1f}%" if r
                     else f"{name} n/a")
    return "  ".join(cells)


def _chart(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "skipped" not in r]
    labels = [f"B{r['batch']}\n{r['context'] // 1024}k" for r in rows]
    names = ("triton_paged", "sdpa_contiguous", "torch_reference")
    width = 0.27
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.9), 4.5))
    for i, name in enumerate(names):
        values = [100 * r[name]["bw_fraction"] if r.get(name) else 0 for r in rows]
        ax.bar([x + (i - 1) * width for x in range(len(rows))], values, width, label=name)
    ax.axhline(75, color="k", linestyle="--", linewidth=0.8, label="target 75%")
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("% of measured copy bandwidth")
    ax.set_title(f"Decode attention, K/V bytes read / time - {result['device']} "
                 f"(copy {result['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------- CPU mode
def naive_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, scale):
    """The obvious implementation: a Python loop over sequences, GQA by repeat_interleave."""
    out = torch.empty_like(q)
    block = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        pages = block_tables[b, : math.ceil(seq_len / block)].long()
        k = k_cache[pages].flatten(0, 1)[:seq_len].repeat_interleave(group, 1)
        v = v_cache[pages].flatten(0, 1)[:seq_len].repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k) * scale
        query_pos = torch.arange(end - start)[:, None] + seq_len - (end - start)
        scores.masked_fill_(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def _best_ms(fn, repeats: int) -> tuple[float, float]:
    """Best of ``repeats`` (wall ms, process CPU ms). The machine is shared: the minimum is
    the signal, and CPU time (all threads summed) barely moves with other people's load."""
    fn()
    wall = cpu = math.inf
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall = min(wall, time.perf_counter() - t0)
        cpu = min(cpu, time.process_time() - c0)
    return wall * 1e3, cpu * 1e3


def bench_cpu(repeats: int, threads: int | None, dtype: torch.dtype) -> int:
    hq, hkv, d, block, scale = 9, 3, 64, 16, 0.125
    if threads:
        torch.set_num_threads(threads)
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"torch reference on CPU ({platform.machine()}, {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} torch threads, load average {load}), "
          f"Hq={hq} Hkv={hkv} D={d} block={block} {dtype}; best of {repeats}")
    # decode: 32 sequences x 512 tokens
    dec = paged_decode_batch(32, 512, hq, hkv, d, block, dtype, "cpu")
    cases = [("decode B=32 ctx=512", dec)]
    # decode at mixed lengths (the throughput benchmark's prompts): 32 x 10..470 tokens
    ragged = paged_decode_batch(32, 512, hq, hkv, d, block, dtype, "cpu", seed=2)
    ragged["seq_lens"] = torch.randint(10, 471, (32,), generator=torch.Generator().manual_seed(2),
                                       dtype=torch.int32)
    cases.append(("decode B=32 ctx=10..470", ragged))
    # mixed: 28 decodes at 512 + 4 prefill chunks of 128 tokens after 256 cached ones
    mixed = paged_decode_batch(32, 512, hq, hkv, d, block, dtype, "cpu", seed=1)
    q_lens = [1] * 28 + [128] * 4
    seq_lens = [512] * 28 + [384] * 4
    mixed["seq_lens"] = torch.tensor(seq_lens, dtype=torch.int32)
    mixed["cu_seqlens_q"] = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()],
                                         dtype=torch.int32)
    mixed["q"] = torch.randn(sum(q_lens), hq, d, dtype=dtype)
    cases.append(("mixed 28 decode@512 + 4 prefill 128@256", mixed))
    for name, b in cases:
        args = attention_args(b, scale)
        diff = float((reference.paged_attention(*args).float()
                      - naive_paged_attention(*args).float()).abs().max())
        ref = _best_ms(lambda: reference.paged_attention(*args), repeats)  # noqa: B023
        naive = _best_ms(lambda: naive_paged_attention(*args), repeats)  # noqa: B023
        print(f"{name}: max|reference - naive| {diff:.1e}\n"
              f"  reference  wall {ref[0]:7.2f} ms  cpu {ref[1]:7.2f} ms  "
              f"(x30 layers: wall {30 * ref[0]:6.0f} ms)\n"
              f"  naive loop wall {naive[0]:7.2f} ms  cpu {naive[1]:7.2f} ms  "
              f"speed-up wall x{naive[0] / ref[0]:.1f}, cpu x{naive[1] / ref[1]:.1f}")
    for tokens in (32, 2048):
        kc = torch.zeros(4096, block, hkv, d, dtype=dtype)
        vc = torch.zeros_like(kc)
        key, value = (torch.randn(tokens, hkv, d, dtype=dtype) for _ in range(2))
        slots = torch.randperm(4096 * block)[:tokens]
        wall, cpu = _best_ms(
            lambda: reference.reshape_and_cache(key, value, kc, vc, slots), repeats)  # noqa: B023
        print(f"reshape_and_cache T={tokens:<5} wall {wall:7.3f} ms  cpu {cpu:7.3f} ms")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-reference", action="store_true",
                        help="benchmark the torch reference on CPU instead of the GPU kernels")
    parser.add_argument("--out-dir", type=Path, default=Path("build/bench_kernels"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="CPU mode: page and query dtype")
    args = parser.parse_args()
    if args.cpu_reference:
        return bench_cpu(args.repeats, args.threads, getattr(torch, args.dtype))
    return bench_gpu(args.out_dir)


if __name__ == "__main__":
    sys.exit(main())
