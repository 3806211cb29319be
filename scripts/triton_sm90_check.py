"""Compile every Triton kernel of kernels/ for Hopper (sm_90) on a machine without a GPU.

The interpreter (TRITON_INTERPRET=1, what CPU tests run) accepts code the GPU compiler
refuses (a non-constexpr global read inside a kernel, a dtype the PTX backend cannot
convert, a tl.dot shape under 16), so a kernel can pass every CPU test and still fail at
its first launch on the device. This script runs the real compiler pipeline (TTIR ->
TTGIR -> LLVM IR -> PTX -> cubin through the ptxas that ships with triton) for the
target GPUTarget("cuda", 90, 32), driving each kernel through its ordinary Python
launcher with CPU tensors: a stand-in driver names the target, and every launch is turned
into a warm-up (compile, never run). Cases: every page format (bf16/fp16/fp32 pages, fp8,
int8, int4) x decode with one and several splits and prefill with cached context, the
cache write, copy-on-write, the mixed-precision arena, and decode and prefill over the
block-quantized formats (kivi4, k8v4, kivi2).

    python scripts/triton_sm90_check.py [--quick]

Uses Triton internals (``triton.runtime.driver.set_active``, ``JITFunction.run``): written
against triton 3.7.1, the pinned CPU version. Exit 0 when every case compiled to a cubin.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("triton_sm90_check.py compiles for the GPU: run it without TRITON_INTERPRET=1")

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET = GPUTarget("cuda", 90, 32)
COMPILED: list[str] = []  # kernel names compiled by the current case


class CompileOnlyDriver:
    """Names the target and a device/stream; nothing is ever launched through it."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return TARGET

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


def _compile_only() -> None:
    driver.set_active(CompileOnlyDriver())
    run = JITFunction.run

    def warmup_instead(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        if kernel is None or "cubin" not in kernel.asm:
            raise RuntimeError(f"{self.fn.__name__}: no cubin for {TARGET}")
        COMPILED.append(self.fn.__name__)
        return kernel

    JITFunction.run = warmup_instead


def _attention_case(fmt: str, dtype: torch.dtype, q_lens: list[int], num_splits: int | None,
                    head_dim: int = 128, block_size: int = 16) -> None:
    from kvscope.engine.runner.page_format import PageFormat
    from kvscope.kernels import triton_backend

    hq, hkv = 32, 8
    seq_lens = [n + 40 for n in q_lens]
    pages = [-(-n // block_size) for n in seq_lens]
    kv = PageFormat(fmt, dtype, 1, block_size, hkv, head_dim).allocate(sum(pages) + 1, "cpu")
    tables = torch.zeros(len(pages), max(pages), dtype=torch.int32)
    start = 0
    for b, n in enumerate(pages):
        tables[b, :n] = torch.arange(start, start + n, dtype=torch.int32)
        start += n
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(cu[-1]), hq, head_dim).to(dtype)
    scales = {"k_scale": kv.k_scales[0] if kv.k_scales else None,
              "v_scale": kv.v_scales[0] if kv.v_scales else None}
    triton_backend.reshape_and_cache(q[:, :hkv].contiguous(), q[:, :hkv].contiguous(),
                                     kv.k_caches[0], kv.v_caches[0],
                                     torch.arange(q.shape[0], dtype=torch.int64), **scales)
    triton_backend.paged_attention(q, kv.k_caches[0], kv.v_caches[0], tables,
                                   torch.tensor(seq_lens, dtype=torch.int32), cu, 0.088,
                                   num_splits=num_splits, **scales)
    mapping = torch.tensor([[0, 1]], dtype=torch.int64)
    per_token = kv.format.scale_params > 0
    triton_backend.copy_blocks([kv.k_caches[0]], [kv.v_caches[0]], mapping,
                               k_scales=kv.k_scales if per_token else None,
                               v_scales=kv.v_scales if per_token else None)


def _block_case(fmt: str, dtype: torch.dtype, q_lens: list[int], head_dim: int = 128) -> None:
    """Attention over block-quantized pages (kernels/triton_block_attention.py): decode
    when every q_len is 1, else prefill with cached context."""
    from kvscope.engine.runner.block_kv import BlockKV
    from kvscope.kernels import triton_block_attention
    from kvscope.kernels.block_quant import block_format

    hq, hkv, block_size = 32, 8, 16
    kv = BlockKV(block_format(fmt), 1, 8, block_size, hkv, head_dim, dtype,
                 torch.device("cpu"))
    tables = torch.arange(8, dtype=torch.int64).view(2, 4)
    cu = torch.tensor([0, *q_lens]).cumsum(0)
    q = torch.randn(int(cu[-1]), hq, head_dim).to(dtype)
    triton_block_attention.block_attention(q, kv.layers[0], tables,
                                           torch.tensor([50, 64], dtype=torch.int64), cu, 0.088)


def cases(quick: bool) -> dict[str, Callable[[], None]]:
    if quick:  # the split-K decode with its reduction, and the quantized prefill
        return {"auto/bfloat16 decode, 4 splits":
                lambda: _attention_case("auto", torch.bfloat16, [1, 1, 1], 4),
                "int4/bfloat16 prefill + context":
                lambda: _attention_case("int4", torch.bfloat16, [7, 19], None)}
    formats = [("auto", torch.bfloat16), ("fp8", torch.bfloat16), ("int8", torch.bfloat16),
               ("int4", torch.bfloat16), ("auto", torch.float16), ("auto", torch.float32)]
    out = {}
    for fmt, dtype in formats:
        name = f"{fmt}/{str(dtype).split('.')[-1]}"
        out[f"{name} decode, 4 splits"] = \
            lambda f=fmt, d=dtype: _attention_case(f, d, [1, 1, 1], 4)
        out[f"{name} prefill + context"] = \
            lambda f=fmt, d=dtype: _attention_case(f, d, [7, 19], None)
        out[f"{name} decode, 1 split, head_dim 64"] = \
            lambda f=fmt, d=dtype: _attention_case(f, d, [1, 1], 1, head_dim=64)
    for fmt in ("kivi4", "k8v4", "kivi2"):
        for dtype in (torch.bfloat16, torch.float32):
            name = f"{fmt}/{str(dtype).split('.')[-1]}"
            out[f"{name} block decode"] = lambda f=fmt, d=dtype: _block_case(f, d, [1, 1])
            out[f"{name} block prefill + context"] = \
                lambda f=fmt, d=dtype: _block_case(f, d, [9, 30])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="two cases: bf16 split-K decode, int4 prefill (CI)")
    args = ap.parse_args(argv)
    _compile_only()
    failed = 0
    for name, case in cases(args.quick).items():
        COMPILED.clear()
        t0 = time.perf_counter()
        try:
            case()
            print(f"ok    {name:<40} {time.perf_counter() - t0:5.1f} s  "
                  f"{', '.join(dict.fromkeys(COMPILED))}", flush=True)
        except Exception:  # noqa: BLE001  (report every case, then fail)
            failed += 1
            print(f"FAIL  {name}\n{traceback.format_exc()}", flush=True)
    print(f"{'all compiled' if not failed else f'{failed} failed'} for sm_90 ({TARGET})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
