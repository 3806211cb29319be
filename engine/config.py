"""EngineConfig: every engine knob, with vLLM's names and defaults where vLLM has one.

Validated once at construction so a bad value is a clear error at start-up, never a
crash mid-generation.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvscope.engine.events import formats

KV_LAYOUTS = ("paged", "contiguous")
PREEMPTION_MODES = ("recompute", "swap")
# the page formats' registry (engine.events.formats); block-quantized pages
# (kernels.block_quant): keys per channel, a full-precision residual
KV_CACHE_DTYPES = formats.KV_CACHE_DTYPES
BLOCK_KV_CACHE_DTYPES = formats.BLOCK_KV_CACHE_DTYPES
EVICTION_POLICIES = ("lru", "lfu", "priority")

# KV memory when the user gives neither num_gpu_blocks nor kv_cache_memory_bytes and no
# GPU is there to profile: enough for ~23k tokens of SmolLM2-135M in fp32.
DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass
class EngineConfig:
    model: str = "smollm2"
    device: str = "auto"
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # default: min(model context, 8192)
    # "dummy": random weights of the model's shapes, seeded by `seed`, no file read
    # (vLLM's --load-format dummy; engine.model.dummy). `model` then names a preset
    # ("llama-3-8b"), or `hf_config` (an HF config.json dict) gives the shapes.
    load_format: str = "auto"
    hf_config: dict[str, Any] | None = None
    # KV cache
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    # Mixed-precision pages: demote cold blocks in place ("int8", "int4", "int8,int4";
    # "" = off) instead of evicting first; never within a sequence's last kv_hot_window
    # tokens (engine.cache.demotion).
    kv_demotion: str = ""
    kv_hot_window: int = 256
    kv_layout: str = "paged"
    enable_prefix_caching: bool = True
    # vLLM's switch: with it a windowed model's layers all keep every block. Without it
    # (and with swap and demotion off) the sliding-window layers get their own cache group
    # whose blocks are freed once out of the window (engine.cache.window_group)
    disable_hybrid_kv_cache_manager: bool = False
    eviction_policy: str = "lru"
    swap_space: float = 0.0  # GiB of host memory for the CPU tier
    # The disk tier below it (engine.cache.disk_tier; off when disk_cache_dir is None):
    # a directory of block files of at most disk_cache_size bytes, kept across restarts.
    # A waiting request whose prefix is on disk waits up to disk_prefetch_wait_s for its
    # reads, then recomputes what has not arrived.
    disk_cache_dir: str | None = None
    disk_cache_size: int = 0
    disk_prefetch_wait_s: float = 2.0
    preemption_mode: str = "recompute"
    # scheduler
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # Prompt tokens a step may compute when it also decodes (0 = up to the step's budget,
    # as vLLM). `kvscope serve` uses 128 (engine.scheduler: arrivals are prefilled in
    # arrival order beside the running decodes, not all at once after a step boundary;
    # P more for every 2 requests waiting, so admissions keep pace under a long queue).
    max_prefill_tokens_with_decodes: int = 0
    watermark: float = 0.01  # share of blocks kept free when admitting new sequences
    # vLLM's name: True runs the model eagerly. None (the default): CUDA replays pure
    # decode steps from CUDA graphs, one per batch-size bucket (engine.runner.cuda_graphs),
    # as vLLM does; CPU runs eagerly. False: CUDA graphs, and on CPU the decode forward
    # torch.compile'd per bucket (engine.runner.compiled; a compile of 15-50 s per bucket).
    enforce_eager: bool | None = None
    # parallelism (vLLM's name): ranks that split the heads and the MLP (engine.distributed)
    tensor_parallel_size: int = 1
    # events
    events_endpoint: str | None = None
    record_path: str | None = None
    # CURVE key directory for events_endpoint (`kvscope keys DIR`; engine.events.wire.keys):
    # required to bind it anywhere but loopback/ipc
    events_keys: str | None = None
    kv_events_config: str | None = None  # vLLM's KVEventsConfig JSON (engine.events.vllm)

    def __post_init__(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"invalid engine config: {msg}")

        from kvscope.engine.model.dummy import LOAD_FORMATS, dummy_name, is_dummy

        need(self.load_format in LOAD_FORMATS,
             f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.load_format == "dummy" or is_dummy(self.model):
            self.load_format, self.model = "dummy", dummy_name(self.model)
        need(self.hf_config is None or self.load_format == "dummy",
             "hf_config gives a dummy model's shapes: it needs load_format='dummy'")
        need(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        need(self.num_gpu_blocks is None or self.num_gpu_blocks >= 1,
             f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")
        need(self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
             "kv_cache_memory_bytes must be > 0")
        need(0.0 < self.gpu_memory_utilization <= 1.0,
             f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        from kvscope.engine.cache.demotion import check_chain

        demotion = tuple(f.strip() for f in self.kv_demotion.split(",")) \
            if self.kv_demotion else ()
        problem = check_chain(demotion) if demotion else None
        need(problem is None, f"kv_demotion={self.kv_demotion!r}: {problem}")
        need(isinstance(self.kv_hot_window, int) and self.kv_hot_window >= 0,
             f"kv_hot_window must be an int >= 0 tokens, got {self.kv_hot_window!r}")
        need(self.kv_layout in KV_LAYOUTS,
             f"kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}")
        need(self.preemption_mode in PREEMPTION_MODES,
             f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        need(self.eviction_policy in EVICTION_POLICIES,
             f"eviction_policy must be one of {EVICTION_POLICIES}, got {self.eviction_policy!r}")
        need(self.swap_space >= 0, f"swap_space must be >= 0 GiB, got {self.swap_space}")
        if self.disk_cache_dir is not None:
            need(self.disk_cache_size > 0, "disk_cache_dir needs disk_cache_size > 0 bytes")
        need(self.disk_prefetch_wait_s >= 0,
             f"disk_prefetch_wait_s must be >= 0, got {self.disk_prefetch_wait_s}")
        need(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        need(self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        need(self.max_prefill_tokens_with_decodes >= 0,
             "max_prefill_tokens_with_decodes must be >= 0 (0: no cap), got "
             f"{self.max_prefill_tokens_with_decodes}")
        need(0.0 <= self.watermark < 1.0, f"watermark must be in [0, 1), got {self.watermark}")
        need(self.tensor_parallel_size >= 1,
             f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        need(self.max_model_len is None or self.max_model_len >= 1,
             f"max_model_len must be >= 1, got {self.max_model_len}")
        need(self.events_keys is None or self.events_endpoint is not None,
             "events_keys secures events_endpoint: give one")
        if self.events_endpoint is not None:
            from kvscope.engine.events.wire.keys import ServerKeys, check_bind

            try:  # both ValueErrors (KeysError is one) name the fix
                check_bind(self.events_endpoint, self.events_keys)
                if self.events_keys is not None:
                    ServerKeys.load(self.events_keys)
            except ValueError as e:
                need(False, str(e))
        # which features combine: the one table (engine.features), once every value is valid
        from kvscope.engine.features import check_config

        check_config(self)
        if self.kv_events_config is not None:
            from kvscope.engine.events.vllm.config import KVEventsConfig

            KVEventsConfig.from_json(self.kv_events_config)  # ValueError with the reason

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments, rejecting unknown names with the valid list."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"unknown argument(s) {unknown}; valid engine arguments: {', '.join(sorted(known))}"
            )
        return cls(**kwargs)
