"""The Triton backend as one module with the four public names (imported lazily by
``kernels`` when a call routes here). swap_blocks is a copy-engine job: the same batched
torch gather/transfer/scatter as the reference."""

from kvscope.kernels.reference import swap_blocks
from kvscope.kernels.triton_attention import paged_attention
from kvscope.kernels.triton_cache import copy_blocks, reshape_and_cache

__all__ = ["reshape_and_cache", "paged_attention", "copy_blocks", "swap_blocks"]
