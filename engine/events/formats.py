"""The KV page formats: the one registry every list of format names derives from.

Torch-free and low in the layers (engine.events, above only kernels) so that the event
schema, the inspector, the config, the CLI and the benches all read the same names. The
torch side of a format (its tensors and byte costs) is ``engine.runner.page_format``; the
numeric codes are ``kernels.quant`` (per-token formats) and ``kernels.block_quant`` (block
formats), whose own name lists tests/events/test_formats.py checks against this one
(kernels sit below this layer and cannot read it).

Invariants: names are unique; ``auto`` is the only selectable float format (it resolves
to the model's dtype, reported as fp32/fp16/bf16); every selectable format is reported
under its own name; the order of ``FORMATS`` is the order of every derived list.
"""

from __future__ import annotations

from dataclasses import dataclass

FLOAT, TOKEN, BLOCK = "float", "token", "block"


@dataclass(frozen=True)
class Format:
    """One page format. ``kind``: FLOAT (the model's dtype), TOKEN (codes with per-token or
    per-head scales, any page takes them) or BLOCK (keys per channel over a block, beside a
    full-precision residual window). ``selectable``: a value of ``kv_cache_dtype``;
    otherwise a name only reported (tier_init) for what ``auto`` resolved to."""

    name: str
    kind: str
    selectable: bool
    summary: str

    @property
    def quantized(self) -> bool:
        """The pages hold codes, not the model's dtype (the inspector's quantized hues)."""
        return self.kind != FLOAT


FORMATS: tuple[Format, ...] = (
    Format("auto", FLOAT, True, "the model's dtype (reported as fp32, fp16 or bf16)"),
    Format("fp16", FLOAT, False, "auto pages of an fp16 model"),
    Format("bf16", FLOAT, False, "auto pages of a bf16 model"),
    Format("fp32", FLOAT, False, "auto pages of an fp32 model"),
    Format("fp8", TOKEN, True, "e4m3 codes, one scale per layer and head"),
    Format("int8", TOKEN, True, "int8 codes, one fp16 scale per token and head"),
    Format("int4", TOKEN, True, "int4 codes, an fp16 scale and zero per token and head"),
    Format("kivi4", BLOCK, True, "4-bit keys per channel, 4-bit values per token"),
    Format("k8v4", BLOCK, True, "8-bit keys per channel, 4-bit values per token"),
    Format("kivi2", BLOCK, True, "2-bit keys per channel, 2-bit values per token"),
)
BY_NAME: dict[str, Format] = {f.name: f for f in FORMATS}
assert len(BY_NAME) == len(FORMATS), "format names are unique"

# Every name a tier_init event may report (engine.events.schema.KV_FORMATS).
NAMES: tuple[str, ...] = tuple(f.name for f in FORMATS)
# The values of kv_cache_dtype (config, --kv-cache-dtype, kvscope bench quant).
KV_CACHE_DTYPES: tuple[str, ...] = tuple(f.name for f in FORMATS if f.selectable)
# The selectable formats of the per-token kernels (kernels.quant.FORMATS).
TOKEN_KV_CACHE_DTYPES: tuple[str, ...] = tuple(
    f.name for f in FORMATS if f.selectable and f.kind != BLOCK)
# The block-quantized formats (kernels.block_quant.FORMATS): a residual window each.
BLOCK_KV_CACHE_DTYPES: tuple[str, ...] = tuple(f.name for f in FORMATS if f.kind == BLOCK)
# The formats whose pages hold codes (the inspector's quantized hues).
QUANTIZED_KV_FORMATS: tuple[str, ...] = tuple(f.name for f in FORMATS if f.quantized)


def is_block(name: str) -> bool:
    """Whether ``name`` is a block-quantized format (False for unknown names)."""
    f = BY_NAME.get(name)
    return f is not None and f.kind == BLOCK
