"""What combines: the one table of engine features that do not go together, and why.

A feature is a named fact about a run ("kv_demotion", "tensor parallelism", "sliding-window
layers"): ``active`` reads them from the config, and, once it is loaded, from the model.
Each row of ``CLASHES`` names two features and the reason they do not combine, and what
happens: REFUSE (a ValueError naming both and the reason) or FALLBACK (the run goes on
without the first feature, as the reason says: the hybrid cache keeps every block in one
group, CUDA graphs give way to eager decode).

The table is checked twice: ``check_config`` from ``EngineConfig.__post_init__`` (the
config's features alone) and ``check_model`` once the model is loaded (the model's
features too); ``fallbacks`` answers the places that fall back (engine.runner.kv_budget
for the hybrid cache, engine.runner.model_runner for CUDA graphs). The lower layers (the
cache manager, the runner, tensor parallelism) keep asserts, or their own API errors, only.
docs/kv-cache.md lists the rows; tests/engine/test_features.py checks the two agree.

Invariants: every row's two features are names of ``FEATURES``; no pair appears twice;
the first refusing row (in table order) is the one reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvscope.engine.events.formats import BLOCK_KV_CACHE_DTYPES

# ``config`` below is an engine.config.EngineConfig, typed Any: the config imports this
# module to check itself, and a type-only import back would tie the two into a circle.
EngineConfig = Any

REFUSE, FALLBACK = "refuse", "fallback"

# name -> what it means. Config features first, then the model's, then the runner's.
FEATURES: dict[str, str] = {
    "kv_demotion": "kv_demotion is set (a mixed-precision arena, engine.runner.mixed_kv)",
    "quantized kv_cache_dtype": "kv_cache_dtype is not 'auto'",
    "block format": f"kv_cache_dtype is one of {', '.join(BLOCK_KV_CACHE_DTYPES)}",
    "swap space": "swap_space > 0 (the cpu tier)",
    "no swap space": "swap_space == 0",
    "contiguous layout": "kv_layout='contiguous'",
    "disk tier": "disk_cache_dir is set",
    "no prefix caching": "enable_prefix_caching is off",
    "tensor parallelism": "tensor_parallel_size > 1",
    "sliding-window layers": "the model has sliding-window layers",
    "hybrid KV cache": "the model has sliding-window layers and "
                       "disable_hybrid_kv_cache_manager is off",
    "gemma3_text": "the model is Gemma 3",
    "CUDA graphs": "a CUDA device and enforce_eager is not True",
    "not the LlamaModel forward": "the model runs a forward other than LlamaModel's "
                                  "(Gemma 3's, a tensor-parallel shard's)",
}


@dataclass(frozen=True)
class Clash:
    """Two features that do not combine. ``outcome``: REFUSE, or FALLBACK (the run goes on
    without ``a``)."""

    a: str
    b: str
    reason: str
    outcome: str = REFUSE

    def message(self) -> str:
        """The one error (or warning) text: both features and the reason."""
        return f"{self.a} and {self.b} do not combine: {self.reason}"


_WINDOW_FORMATS = "use --kv-cache-dtype fp8, int8 or int4 (both groups take them)"

CLASHES: tuple[Clash, ...] = (
    Clash("kv_demotion", "quantized kv_cache_dtype",
          "kv_demotion keeps hot pages at full precision: it needs kv_cache_dtype='auto'"),
    Clash("kv_demotion", "swap space",
          "swapped and offloaded blocks would need per-block formats on the host: "
          "kv_demotion needs no swap space (swap_space=0)"),
    Clash("kv_demotion", "contiguous layout",
          "the mixed-precision arena is a pool of pages: kv_demotion needs the paged layout"),
    Clash("block format", "swap space",
          "a block format keeps a residual window beside its pages, which the cpu tier "
          "does not move: it needs no swap space (swap_space=0)"),
    Clash("block format", "contiguous layout",
          "a block format keeps a residual window beside its pages: it needs the paged "
          "layout"),
    Clash("disk tier", "no swap space",
          "the disk tier stores the host tier's evicted prefix-cache blocks: it needs "
          "swap_space > 0"),
    Clash("disk tier", "no prefix caching",
          "the disk tier stores the host tier's evicted prefix-cache blocks: it needs "
          "prefix caching"),
    Clash("tensor parallelism", "kv_demotion",
          "the ranks hold plain pages: none builds the mixed-precision arena"),
    Clash("tensor parallelism", "contiguous layout",
          "the ranks hold paged KV only (engine.distributed.tp)"),
    Clash("tensor parallelism", "swap space",
          "the worker ranks have no cpu tier to swap their shard of the pages to"),
    Clash("tensor parallelism", "gemma3_text",
          "its ranks would run the Llama forward, not Gemma 3's"),
    Clash("sliding-window layers", "kv_demotion",
          "the mixed-precision arena's attention takes no window, and its demotion policy "
          "and frames cover one pool, not the hybrid cache's window group; "
          + _WINDOW_FORMATS),
    Clash("sliding-window layers", "block format",
          "the block-quantized attention (C, torch and Triton paths) takes no window, and "
          "the runner has no per-group page format (the full-attention layers' pages "
          "block-quantized beside the window group's in the model dtype); "
          + _WINDOW_FORMATS),
    Clash("hybrid KV cache", "disk tier",
          "beside a window group the cpu tier is swap space only, no host prefix cache "
          "(a host hit would need the window blocks of its last W tokens on the host too): "
          "every layer keeps every block", FALLBACK),
    Clash("hybrid KV cache", "contiguous layout",
          "the window group is a pool of pages: every layer keeps every block", FALLBACK),
    Clash("hybrid KV cache", "tensor parallelism",
          "the ranks' commands carry one group's slots and copy orders: every layer keeps "
          "every block", FALLBACK),
    Clash("CUDA graphs", "kv_demotion",
          "the mixed arena's kernels were never captured on a device: decode runs eagerly",
          FALLBACK),
    Clash("CUDA graphs", "block format",
          "the block-quantized attention was never captured: decode runs eagerly", FALLBACK),
    Clash("CUDA graphs", "hybrid KV cache",
          "the decode graphs take one group's slots and tables: decode runs eagerly",
          FALLBACK),
    Clash("CUDA graphs", "not the LlamaModel forward",
          "the graphs are captured over LlamaModel's forward only: decode runs eagerly",
          FALLBACK),
)


def active(config: EngineConfig, model_config: Any = None) -> set[str]:
    """The features a config (and, when given, its model) turns on."""
    on = {
        "kv_demotion": bool(config.kv_demotion),
        "quantized kv_cache_dtype": config.kv_cache_dtype != "auto",
        "block format": config.kv_cache_dtype in BLOCK_KV_CACHE_DTYPES,
        "swap space": config.swap_space > 0,
        "no swap space": config.swap_space == 0,
        "contiguous layout": config.kv_layout == "contiguous",
        "disk tier": config.disk_cache_dir is not None,
        "no prefix caching": not config.enable_prefix_caching,
        "tensor parallelism": config.tensor_parallel_size > 1,
    }
    if model_config is not None:
        windowed = bool(model_config.windowed)
        on |= {
            "sliding-window layers": windowed,
            "hybrid KV cache": windowed and not config.disable_hybrid_kv_cache_manager,
            "gemma3_text": model_config.architecture == "gemma3_text",
        }
    return {name for name, yes in on.items() if yes}


def clashes(features: set[str], outcome: str | None = None) -> list[Clash]:
    """The rows whose two features are both in ``features`` (of ``outcome`` when given),
    in table order."""
    return [c for c in CLASHES if c.a in features and c.b in features
            and (outcome is None or c.outcome == outcome)]


def fallbacks(features: set[str], feature: str) -> list[Clash]:
    """The FALLBACK rows that switch ``feature`` off among ``features`` (empty: it
    applies, or it is not among them)."""
    return [c for c in clashes(features, FALLBACK) if c.a == feature]


def refuse(features: set[str], prefix: str = "") -> None:
    """Raise ValueError for the first REFUSE row among ``features``: both features and the
    reason, after ``prefix``."""
    for c in clashes(features, REFUSE):
        raise ValueError(f"{prefix}{c.message()}")


def check_config(config: EngineConfig) -> None:
    """The config's own features; called from ``EngineConfig.__post_init__``."""
    refuse(active(config), "invalid engine config: ")


def check_model(config: EngineConfig, model_config: Any) -> list[Clash]:
    """The config's and the model's features, once the model is loaded: raise for the
    first refusal (naming the model), else return the fallbacks that apply."""
    features = active(config, model_config)
    refuse(features, f"{model_config.architecture}: ")
    return clashes(features, FALLBACK)
