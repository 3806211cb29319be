"""How many KV blocks the engine's tiers get, in pages of the device's format.

The gpu pool: ``num_gpu_blocks`` when given; else a byte budget (``kv_cache_memory_bytes``;
on CUDA, what a profiled forward leaves of ``gpu_memory_utilization``; on CPU,
``DEFAULT_CPU_KV_BYTES``) divided by the bytes of one block (scales included), or of one
frame over a mixed-precision arena (``--kv-demotion``). The cpu tier: ``swap_space`` GiB.
The disk tier: ``disk_cache_size`` bytes of block files (a header and the token ids each).
"""

from __future__ import annotations

import torch

from engine.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from engine.runner import mixed_kv
from engine.runner.page_format import PageFormat
from kernels import mixed_pages as mp


def num_gpu_blocks(config: EngineConfig, fmt: PageFormat, mixed: mp.MixedLayout | None,
                   model: torch.nn.Module, model_config, device: torch.device) -> int:
    """Blocks (frames over a mixed arena) of the gpu pool; ValueError when the budget
    holds none."""
    per_block = fmt.bytes_per_block  # scales included
    if mixed is not None:
        per_block = mixed_kv.bytes_per_frame(mixed, model_config.num_layers)
    if config.num_gpu_blocks is not None:
        return config.num_gpu_blocks
    if config.kv_cache_memory_bytes is not None:
        budget = config.kv_cache_memory_bytes
    elif device.type == "cuda":
        budget = _profile_cuda_budget(config, model, model_config, device)
    else:
        budget = DEFAULT_CPU_KV_BYTES
    blocks = budget // per_block
    if blocks < 1:
        raise ValueError(f"KV cache budget of {budget} bytes holds no block of "
                         f"{per_block} bytes; raise it")
    return int(blocks)


def num_cpu_blocks(config: EngineConfig, fmt: PageFormat) -> int:
    """Blocks of the cpu tier: ``swap_space`` GiB of pages of the device's format."""
    blocks = int(config.swap_space * (1 << 30)) // fmt.bytes_per_block
    if config.preemption_mode == "swap" and blocks < 1:
        raise ValueError(f"preemption_mode='swap' needs swap_space > 0 GiB holding at "
                         f"least one block of {fmt.bytes_per_block} bytes")
    return blocks


def num_disk_blocks(config: EngineConfig, fmt: PageFormat) -> int:
    """Blocks of the disk tier (0: off): block files that fit ``disk_cache_size``."""
    if config.disk_cache_dir is None:
        return 0
    from engine.runner.disk_store import file_bytes

    blocks = config.disk_cache_size // file_bytes(config.block_size, fmt.bytes_per_block)
    if blocks < 1:
        raise ValueError(f"disk_cache_size {config.disk_cache_size} bytes holds no block "
                         f"file of {file_bytes(config.block_size, fmt.bytes_per_block)} bytes")
    return int(blocks)


@torch.inference_mode()
def _profile_cuda_budget(config: EngineConfig, model: torch.nn.Module, model_config,
                         device: torch.device) -> int:
    """Free memory after a forward of max_num_batched_tokens, times the utilisation."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    n = config.max_num_batched_tokens
    ids = torch.zeros(n, dtype=torch.int64, device=device)
    pos = torch.arange(n, device=device)
    from kernels.contiguous import contiguous_attention

    scale = model_config.head_dim ** -0.5

    def attn(layer, q, k, v):
        return contiguous_attention(q, k, v, 0, scale)

    model.compute_logits(model.forward(ids, pos, attn)[-1:])
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    used_other = total - free - torch.cuda.memory_allocated(device)
    peak = torch.cuda.max_memory_allocated(device)
    return int(total * config.gpu_memory_utilization - peak - used_other)
