"""Page formats of the paged KV cache: what one block costs, and the tensors that hold it.

A block of ``block_size`` tokens holds, in every layer, K and V codes
``[block_size, Hkv, packed_dim]`` plus, for int8/int4, per-token scale pages
``[block_size, Hkv, P]`` (fp16; P = 1 scale, or 2 = scale and zero). ``bytes_per_block``
counts both, so ``num_blocks = budget // bytes_per_block`` fills a byte budget exactly.
fp8's per-head scales are per layer, not per block (2 * layers * Hkv fp32 values in all),
and are not counted. The numeric formats themselves live in ``kernels.quant``.

Bytes per token per KV head at head_dim 64 (SmolLM2): fp32 256, fp16/bf16 128, fp8 64,
int8 64 + 2 = 66 (1.94x smaller than fp16), int4 32 + 4 = 36 (3.56x).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.kernels import block_quant, quant

# Names the cache manager's tier_init events report (engine.events.schema.KV_FORMATS).
_FLOAT_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class PageFormat:
    kv_cache_dtype: str  # "auto" | "fp8" | "int8" | "int4"
    model_dtype: torch.dtype
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.is_block:  # kernels.block_quant: keys per channel, a residual window
            fmt = block_quant.block_format(self.kv_cache_dtype)
            fmt.packed_dim(fmt.key_bits, self.head_dim)
            fmt.packed_dim(fmt.value_bits, self.head_dim)
        else:
            quant.packed_dim(self.kv_cache_dtype, self.head_dim)  # unknown name / odd dim
        if self.model_dtype not in _FLOAT_NAMES:
            raise ValueError(f"model dtype {self.model_dtype} has no KV page format")

    @property
    def is_block(self) -> bool:
        """A block-quantized format (engine.runner.block_kv owns its pages)."""
        return self.kv_cache_dtype in block_quant.FORMATS

    @property
    def cache_dtype(self) -> torch.dtype:
        if self.is_block:
            return torch.uint8
        return quant.cache_dtype(self.kv_cache_dtype, self.model_dtype)

    @property
    def name(self) -> str:
        """The format as tier_init reports it: fp32/fp16/bf16 for auto, else the dtype."""
        if self.kv_cache_dtype == "auto":
            return _FLOAT_NAMES[self.model_dtype]
        return self.kv_cache_dtype

    @property
    def packed_dim(self) -> int:
        return quant.packed_dim(self.kv_cache_dtype, self.head_dim)

    @property
    def scale_params(self) -> int:
        return quant.scale_params(self.kv_cache_dtype)

    @property
    def bytes_per_token_head(self) -> float:
        """One token's K (or V) vector of one KV head, codes plus its scales (block
        formats: K and V averaged, per-block scales amortised over the block)."""
        if self.is_block:
            return block_quant.block_format(self.kv_cache_dtype).bytes_per_token_head(
                self.head_dim, self.block_size)
        data = self.packed_dim * _element_size(self.cache_dtype)
        return data + self.scale_params * _element_size(quant.SCALE_DTYPE)

    @property
    def bytes_per_block(self) -> int:
        """One block across all layers, K and V, scales included."""
        return int(2 * self.num_layers * self.block_size * self.num_kv_heads *
                   self.bytes_per_token_head)

    def rotation(self, device: torch.device | str = "cpu") -> torch.Tensor | None:
        """The [head_dim, head_dim] Hadamard matrix H whose basis quantized pages store K and
        V in (k H, v H; q H attends, the output is rotated back by H^T), or None: auto
        pages, or a head_dim that is not a power of two. Why: SmolLM2's keys have a few
        outlier channels (|k| ~16 against a median ~1) that set every per-token scale;
        rotation spreads them, halving int8's attention error (docs/BENCHMARKS.md)."""
        if self.kv_cache_dtype == "auto" or self.is_block or \
                self.head_dim & (self.head_dim - 1):
            return None
        return quant.hadamard(self.head_dim, self.model_dtype, device)

    def num_blocks(self, budget_bytes: int) -> int:
        return int(budget_bytes) // self.bytes_per_block

    def allocate(self, num_blocks: int, device: torch.device,
                 layer_blocks: list[int] | None = None) -> KVPages:
        """Zeroed K/V pages (and scale pages) for every layer; ``layer_blocks``: each
        layer's own block count (a hybrid cache's sliding-window layers have their own,
        smaller pool, engine.cache.window_group), else ``num_blocks`` for all."""
        counts = layer_blocks or [num_blocks] * self.num_layers
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.packed_dim)

        def pages(dtype: torch.dtype, tail: tuple[int, ...]) -> list[torch.Tensor]:
            return [torch.zeros((n, *shape[1:3], *tail), dtype=dtype, device=device)
                    for n in counts]

        k, v = pages(self.cache_dtype, shape[3:]), pages(self.cache_dtype, shape[3:])
        k_scales = v_scales = None
        if self.scale_params:
            k_scales = pages(quant.SCALE_DTYPE, (self.scale_params,))
            v_scales = pages(quant.SCALE_DTYPE, (self.scale_params,))
        elif self.kv_cache_dtype == "fp8":  # per layer, per head; 1.0 until calibrated
            k_scales = [torch.ones(self.num_kv_heads, dtype=torch.float32, device=device)
                        for _ in range(self.num_layers)]
            v_scales = [s.clone() for s in k_scales]
        return KVPages(self, k, v, k_scales, v_scales)


@dataclass
class KVPages:
    """The cache tensors of one device tier. ``k_scales``/``v_scales``: per layer, per-token
    scale pages (int8/int4: indexed by block like the pages, so copy and swap must move
    them too), fp8 per-head scales [Hkv] (not per block), or None (auto)."""

    format: PageFormat
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    k_scales: list[torch.Tensor] | None
    v_scales: list[torch.Tensor] | None

    @property
    def per_block_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by block id: what a swap between tiers must move."""
        tensors = [*self.k_caches, *self.v_caches]
        if self.format.scale_params:
            tensors += [*self.k_scales, *self.v_scales]
        return tensors


def page_format(kv_cache_dtype: str, model_dtype: torch.dtype, model_config,
                block_size: int) -> PageFormat:
    """The page format of a model's cache (model_config: num_layers, num_kv_heads,
    head_dim)."""
    return PageFormat(kv_cache_dtype, model_dtype, model_config.num_layers, block_size,
                      model_config.num_kv_heads, model_config.head_dim)


def check_supported(kv_cache_dtype: str, device: torch.device) -> None:
    """Raise ValueError at start-up when ``device`` cannot run the format's kernels."""
    if kv_cache_dtype in block_quant.FORMATS:
        if device.type != "cpu":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} (block-quantized pages) "
                             f"runs on CPU only so far; on {device.type} use int8 or int4")
        return
    if kv_cache_dtype not in quant.FORMATS:
        raise ValueError(f"kv_cache_dtype must be one of {quant.FORMATS}, "
                         f"got {kv_cache_dtype!r}")
    if kv_cache_dtype != "fp8":
        return
    if not hasattr(torch, "float8_e4m3fn"):
        raise ValueError("kv_cache_dtype='fp8' needs torch.float8_e4m3fn, which this torch "
                         f"{torch.__version__} lacks; use 'int8'")
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(f"kv_cache_dtype='fp8' needs a GPU of compute capability >= 8.9 "
                             f"(Ada/Hopper) for e4m3 in Triton; this one is {major}.{minor}. "
                             "Use 'int8'")
    elif device.type != "cpu":
        raise ValueError(f"kv_cache_dtype='fp8' is not supported on {device.type}")


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
