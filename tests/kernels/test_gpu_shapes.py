"""Triton paged attention at Llama-3-8B's head shapes (32 q / 8 KV heads, head_dim 128) on
the GPU, against the CPU reference: every page format, block sizes 1..256, split-K decode
over long contexts and prefill with cached context. Too big for the interpreter, so these
run only on a CUDA device (scripts/gpu_check.py's kernels section runs block sizes 1, 16
and 128 of them); the interpreter tests beside this file cover the same code paths at tiny
shapes on CPU."""

from __future__ import annotations

import pytest
import torch

from kvscope import kernels
from kvscope.kernels import reference
from tests.quant.pages import filled_pages

pytestmark = pytest.mark.gpu

HQ, HKV, D = 32, 8, 128
BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
FORMATS = ["auto", "fp8", "int8", "int4"]
# (seq_lens, q_lens): decode mixes one-token, page-boundary and long (split-K) sequences;
# prefill has cached context ending mid-page and whole-page chunks.
MODES = {
    "decode": lambda bs: ([1, bs + 1, 3 * bs - 1 if bs > 1 else 3, 1500, 4097], [1] * 5),
    "prefill": lambda bs: ([bs + 7, 300, 777], [7, 64, 100]),
}


def _case(fmt: str, block_size: int, mode: str, seed: int):
    seq_lens, q_lens = MODES[mode](block_size)
    gen = torch.Generator().manual_seed(seed)
    pages = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(pages) + 3
    if fmt == "auto":
        k = torch.randn(num_blocks, block_size, HKV, D, generator=gen).to(torch.bfloat16)
        v = torch.randn(num_blocks, block_size, HKV, D, generator=gen).to(torch.bfloat16)
        caches, scales, dense = (k, v), {}, (k.float(), v.float())
    else:
        p = filled_pages(fmt, num_blocks, block_size, HKV, D, seed=seed)
        caches, scales, dense = (p.k_cache, p.v_cache), p.scales, p.dequantized()
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages):
        tables[b, :n] = perm[used:used + n].int()
        used += n
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    q = torch.randn(int(cu[-1]), HQ, D, generator=gen).to(torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return q, caches, scales, dense, tables, lens, cu


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_paged_attention_at_8b_head_shapes(block_size, fmt, mode, device):
    q, (k, v), scales, (k_deq, v_deq), tables, lens, cu = _case(fmt, block_size, mode,
                                                               seed=block_size)
    scale = D ** -0.5
    want = reference.paged_attention(q.float(), k_deq, v_deq, tables, lens, cu, scale)
    dev = {name: (s.to(device) if s is not None else None) for name, s in scales.items()}
    out = torch.full_like(q, float("nan"), device=device)  # every row must be written
    with kernels.force_backend("triton"):
        got = kernels.paged_attention(q.to(device), k.to(device), v.to(device),
                                      tables.to(device), lens.to(device), cu.to(device), scale,
                                      out=out, **dev)
    torch.cuda.synchronize()
    got = got.float().cpu()
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=3e-2, rtol=3e-2)
