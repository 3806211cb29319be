"""KVSpec: the KV cache's layout, decided once and handed whole to who builds on it.

Built where the budget is planned (``engine.runner.kv_budget.build``), from the config,
the model and the device; the cache manager (its pools), the model runner (its pages)
and tensor parallelism (every rank's pages) each take the one spec, so none re-derives
the page format or re-reads ``kv_cache_dtype``. Torch-free, so the cache manager (pure
Python) can hold it; the torch side of the format rides along in ``page``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvscope.engine.events import formats


@dataclass(frozen=True)
class KVSpec:
    """The blocks of every tier and cache group, in pages of one format.

    ``num_blocks``: the gpu pool (group 0: every layer, or the full-attention layers of a
    hybrid cache; frames over a mixed arena). ``num_cpu_blocks``/``num_disk_blocks``: the
    lower tiers (0: off). ``window``: the hybrid cache's sliding window (None: one group,
    every layer keeps every block); ``num_window_blocks``/``num_window_cpu_blocks`` are
    then the windowed layers' own pools (engine.cache.window_group).

    ``format``: the page format's name as tier_init reports it (a registry name,
    engine.events.formats: fp32/fp16/bf16 for auto pages). ``page``: its torch side
    (engine.runner.page_format.PageFormat; None where only the bookkeeping is built),
    ``mixed``: the --kv-demotion arena's layout (kernels.mixed_pages.MixedLayout) or None.

    Invariants (asserted): ``format`` is a registry name and ``page``, when given, reports
    it and has this block size; a window comes with its own pool. The sizes themselves
    are checked by whoever builds on them (the cache manager's CacheErrors)."""

    block_size: int
    num_blocks: int
    num_cpu_blocks: int = 0
    num_disk_blocks: int = 0
    window: int | None = None
    num_window_blocks: int = 0
    num_window_cpu_blocks: int = 0
    format: str = "auto"
    page: Any = None
    mixed: Any = None

    def __post_init__(self) -> None:
        assert self.format in formats.NAMES, f"unknown page format {self.format!r}"
        assert self.page is None or (self.page.name == self.format and
                                     self.page.block_size == self.block_size), \
            "the page format must be the one the spec names"
        assert self.window is None or self.num_window_blocks, "a window needs its own pool"

    @property
    def hybrid(self) -> bool:
        """Two cache groups: the sliding-window layers keep their own pool."""
        return self.window is not None

    def replace(self, **changes: Any) -> KVSpec:
        """A copy with ``changes`` (e.g. a tensor-parallel rank's ``page``)."""
        return dataclasses.replace(self, **changes)
