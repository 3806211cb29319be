"""How many KV blocks the engine's tiers get, in pages of the device's format.

The gpu pool: ``num_gpu_blocks`` when given; else a byte budget (``kv_cache_memory_bytes``;
on CUDA, what a profiled forward leaves of ``gpu_memory_utilization``; on CPU,
``DEFAULT_CPU_KV_BYTES``) divided by the bytes of one block (scales included), or of one
frame over a mixed-precision arena (``--kv-demotion``). The cpu tier: ``swap_space`` GiB.
The disk tier: ``disk_cache_size`` bytes of block files (a header and the token ids each).
A hybrid cache (``hybrid_split``) divides the gpu budget between the full-attention
layers' pool and the sliding-window layers' pool. ``plan`` is all of it, and ``build``
the engine's KVSpec (engine.cache.spec) with it: the one place the page format is made.
"""

from __future__ import annotations

import logging

import torch

from kvscope.engine import features
from kvscope.engine.cache.spec import KVSpec
from kvscope.engine.config import DEFAULT_CPU_KV_BYTES, EngineConfig
from kvscope.engine.events.state_store import MAX_TIER_BLOCKS
from kvscope.engine.runner import mixed_kv
from kvscope.engine.runner.page_format import PageFormat, page_format
from kvscope.kernels import mixed_pages as mp

log = logging.getLogger(__name__)


# The disk tier's largest pool: the largest tier an event mirror builds, so a 20 TiB
# budget costs a bounded ~200 MB of bookkeeping, not gigabytes.
MAX_DISK_BLOCKS = MAX_TIER_BLOCKS


def build(config: EngineConfig, model: torch.nn.Module, model_config,
          device: torch.device, dtype: torch.dtype, max_model_len: int) -> KVSpec:
    """The engine's KVSpec, built once: the page format of ``kv_cache_dtype`` over the
    model's dtype, the --kv-demotion arena's layout, and every tier's and group's blocks
    (``plan``). The cache manager, the runner and tensor parallelism all take it whole."""
    fmt = page_format(config.kv_cache_dtype, dtype, model_config, config.block_size)
    # --kv-demotion: an arena of frames (engine.runner.mixed_kv); num_blocks then counts frames
    mixed = mixed_kv.mixed_layout(config.kv_demotion, dtype, model_config, config.block_size)
    return plan(config, fmt, mixed, model, model_config, device, max_model_len)


def spec_of(kv_cache_dtype: str, model_dtype: torch.dtype, model_config, block_size: int,
            num_blocks: int, **sizes) -> KVSpec:
    """A KVSpec of given sizes (benches, tools and tests that build a runner without an
    engine): pages of ``kv_cache_dtype`` over ``model_dtype``; ``sizes``: the other
    KVSpec fields (num_cpu_blocks, window, num_window_blocks, mixed, ...)."""
    fmt = page_format(kv_cache_dtype, model_dtype, model_config, block_size)
    return KVSpec(block_size, num_blocks, format=fmt.name, page=fmt, **sizes)


def plan(config: EngineConfig, fmt: PageFormat, mixed: mp.MixedLayout | None,
         model: torch.nn.Module, model_config, device: torch.device,
         max_model_len: int) -> KVSpec:
    """Every tier's blocks, and the hybrid split for a windowed model where it applies
    (the features table says where it does not: engine.features)."""
    bs = config.block_size
    num_blocks = num_gpu_blocks(config, fmt, mixed, model, model_config, device)
    num_cpu = num_cpu_blocks(config, fmt)
    num_disk = num_disk_blocks(config, fmt)
    if not hybrid_applies(config, model_config):
        for clash in features.fallbacks(features.active(config, model_config),
                                        "hybrid KV cache"):
            log.warning("%s has sliding-window layers, but %s", model_config.architecture,
                        clash.message())
        return KVSpec(bs, num_blocks, num_cpu, num_disk, format=fmt.name, page=fmt,
                      mixed=mixed)
    window = max(w for w in model_config.layer_windows if w is not None)
    num_full, num_window = hybrid_split(config, model_config, num_blocks, max_model_len)
    num_window_cpu = 0
    if num_cpu:  # swap space for both groups (engine.cache.window_group)
        num_cpu, num_window_cpu = hybrid_host_split(model_config, num_cpu, num_full,
                                                    num_window, bs, max_model_len)
    log.info("hybrid KV cache: %d full-attention blocks, %d sliding-window blocks "
             "(window %d); cpu tier %d + %d blocks", num_full, num_window, window, num_cpu,
             num_window_cpu)
    return KVSpec(bs, num_full, num_cpu, num_disk, window, num_window, num_window_cpu,
                  format=fmt.name, page=fmt, mixed=mixed)


def hybrid_applies(config: EngineConfig, model_config) -> bool:
    """Whether a windowed model gets the hybrid cache (prefix caching and swap included):
    not when switched off, and not where the features table (engine.features) says it
    falls back (it then keeps every block, as before)."""
    on = features.active(config, model_config)
    return "hybrid KV cache" in on and not features.fallbacks(on, "hybrid KV cache")


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
    from kvscope.engine.runner.disk_store import file_bytes

    per_file = file_bytes(config.block_size, fmt.bytes_per_block)
    blocks = config.disk_cache_size // per_file
    if blocks < 1:
        raise ValueError(f"disk_cache_size {config.disk_cache_size} bytes holds no block "
                         f"file of {per_file} bytes")
    if blocks > MAX_DISK_BLOCKS:
        # the disk pool's bookkeeping is allocated per block at start-up (~50 bytes each),
        # and no event mirror takes a tier over MAX_TIER_BLOCKS: cap it, and say so
        log.warning("--disk-cache-size %d bytes is %d block files of %d bytes; the disk tier "
                    "holds at most %d (%.1f GiB of files) and uses that many",
                    config.disk_cache_size, blocks, per_file, MAX_DISK_BLOCKS,
                    MAX_DISK_BLOCKS * per_file / (1 << 30))
        blocks = MAX_DISK_BLOCKS
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
    from kvscope.kernels.contiguous import contiguous_attention

    scale = model_config.head_dim ** -0.5

    def attn(layer, q, k, v):
        return contiguous_attention(q, k, v, 0, scale)

    model.compute_logits(model.forward(ids, pos, attn)[-1:])
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    used_other = total - free - torch.cuda.memory_allocated(device)
    peak = torch.cuda.max_memory_allocated(device)
    return int(total * config.gpu_memory_utilization - peak - used_other)


def hybrid_split(config: EngineConfig, model_config, num_blocks: int,
                 max_model_len: int) -> tuple[int, int]:
    """(full-attention group blocks, window group blocks) of a hybrid cache, from the gpu
    pool ``num_blocks`` counts blocks of every layer.

    Given ``num_gpu_blocks``: the full group keeps that count and the window group gets
    as many (never more than the running sequences can hold at once: ``max_num_seqs``
    windows of ceil(W / block_size) + 1 blocks plus one prefill chunk; never fewer than
    one prefill chunk beside its window, ``window_floor``: with less, a prompt longer than
    the pool would wait forever). Given a byte
    budget: the window pool first gets one step's prefill chunk (``max_num_batched_tokens``:
    a chunk holds its own positions beside its window), then the rest is split in the
    proportion of what a sequence of ``max_model_len`` tokens needs in each group (the
    full layers: all its blocks; the windowed layers: a window), so both pools run out
    together for sequences of that length. A model with no
    full-attention layer (Mistral) spends it all on the window pool; its full group is
    then bookkeeping only (no pages), sized to never be the limit."""
    windows = model_config.layer_windows
    window = max(w for w in windows if w is not None)
    n_win = sum(w is not None for w in windows)
    n_full = len(windows) - n_win
    bs = config.block_size
    per_window_seq = -(-window // bs) + 1
    wanted = config.max_num_seqs * per_window_seq + -(-config.max_num_batched_tokens // bs)
    per_seq = -(-max_model_len // bs)
    floor = window_floor(config, window, max_model_len)
    if config.num_gpu_blocks is not None:
        num_window = max(min(num_blocks, wanted), floor)
        full = num_blocks if n_full else (num_window // per_window_seq + 1) * per_seq
        return full, num_window
    layer_blocks = num_blocks * len(windows)  # the budget, in blocks of one layer
    if not n_full:
        num_window = layer_blocks // n_win
        return (num_window // per_window_seq + 1) * per_seq, num_window
    # a step's prefill chunks hold up to max_num_batched_tokens more window positions
    # than their windows: that reserve first, the rest in the proportion of steady needs
    chunk = min(-(-config.max_num_batched_tokens // bs), per_seq)
    rest = layer_blocks - chunk * n_win
    full_need, win_need = per_seq * n_full, min(per_window_seq, per_seq) * n_win
    num_window = min(wanted, chunk + max(1, rest * win_need // (full_need + win_need) // n_win))
    if num_window < floor:
        raise ValueError(f"the KV cache budget leaves the sliding-window layers {num_window} "
                         f"blocks; one prefill chunk of max_num_batched_tokens="
                         f"{config.max_num_batched_tokens} beside its {window}-token window "
                         f"needs {floor}: raise the budget or lower max_num_batched_tokens")
    num_full = (layer_blocks - num_window * n_win) // n_full
    if num_full < 1:
        raise ValueError("the KV cache budget holds no full-attention block beside the "
                         "window group's; raise it")
    return num_full, num_window


def window_floor(config: EngineConfig, window: int, max_model_len: int) -> int:
    """Window-group blocks one sequence alone needs for its largest step: a prefill chunk
    (at most ``max_num_batched_tokens``, never past ``max_model_len``) holds its own
    positions beside the W - 1 before it (engine.cache.window_group), plus a partial
    block at each end."""
    chunk = min(config.max_num_batched_tokens, max_model_len)
    return -(-(window - 1 + chunk) // config.block_size) + 1


def hybrid_host_split(model_config, num_cpu_blocks: int, num_full: int, num_window: int,
                      block_size: int, max_model_len: int) -> tuple[int, int]:
    """(group-0 host blocks, window group host blocks) of a hybrid cache's cpu tier, from
    ``num_cpu_blocks`` (``swap_space`` in blocks of every layer).

    The cpu tier is swap space for what preempted sequences held on the gpu, so its bytes
    are split in the gpu pools' proportion (full layers x ``num_full`` : windowed layers x
    ``num_window``). A model with no full-attention layer spends it all on the window
    group's host pool; its group 0 is bookkeeping only, sized to never be the limit."""
    windows = model_config.layer_windows
    window = max(w for w in windows if w is not None)
    n_win = sum(w is not None for w in windows)
    n_full = len(windows) - n_win
    layer_blocks = num_cpu_blocks * len(windows)  # the budget, in blocks of one layer
    if not n_full:
        host_window = max(1, layer_blocks // n_win)
        per_window_seq = -(-window // block_size) + 1
        return (host_window // per_window_seq + 1) * -(-max_model_len // block_size), \
            host_window
    win_bytes, full_bytes = num_window * n_win, num_full * n_full
    host_window = max(1, layer_blocks * win_bytes // (win_bytes + full_bytes) // n_win)
    host_full = (layer_blocks - host_window * n_win) // n_full
    if host_full < 1:
        raise ValueError("swap_space holds no full-attention block beside the window "
                         "group's; raise it")
    return host_full, host_window
