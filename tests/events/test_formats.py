"""Every list of KV page format names is the registry's (engine.events.formats): the
config's, the CLI's choices, kvscope bench quant's, the event schema's, the inspector's
quantized hues, the cache's demotion targets, and the kernels' own lists (which sit below
the registry and cannot read it, so they are compared here)."""

from __future__ import annotations

import argparse

import pytest

from kvscope.engine.events import formats as F


def test_the_registry_is_consistent():
    assert len(set(F.NAMES)) == len(F.NAMES)
    assert F.KV_CACHE_DTYPES[0] == "auto"
    assert set(F.BLOCK_KV_CACHE_DTYPES) | set(F.TOKEN_KV_CACHE_DTYPES) == set(F.KV_CACHE_DTYPES)
    assert not set(F.BLOCK_KV_CACHE_DTYPES) & set(F.TOKEN_KV_CACHE_DTYPES)
    assert all(F.is_block(n) for n in F.BLOCK_KV_CACHE_DTYPES)
    assert not F.is_block("int8") and not F.is_block("nope")


def test_the_config_and_bench_lists_are_the_registry():
    from kvscope.engine import config
    from kvscope.engine.bench import quant

    assert config.KV_CACHE_DTYPES == F.KV_CACHE_DTYPES
    assert config.BLOCK_KV_CACHE_DTYPES == F.BLOCK_KV_CACHE_DTYPES
    assert quant.DTYPES == F.KV_CACHE_DTYPES


def test_the_schema_and_inspector_lists_are_the_registry():
    from kvscope.engine.events import schema as S
    from kvscope.inspector import palette

    assert S.KV_FORMATS == F.NAMES
    assert S.QUANTIZED_KV_FORMATS == F.QUANTIZED_KV_FORMATS == palette.QUANTIZED_FORMATS


def test_the_cache_lists_are_the_registry():
    from kvscope.engine.cache import mixed_pool

    assert mixed_pool.BLOCK_FORMATS == F.BLOCK_KV_CACHE_DTYPES
    assert set(mixed_pool.DEMOTION_BITS) <= set(F.QUANTIZED_KV_FORMATS)


def test_the_cli_choices_are_the_registry():
    from kvscope.engine.cli import build_parser

    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in serve.choices["serve"]._actions
                  if "--kv-cache-dtype" in a.option_strings)
    assert tuple(action.choices) == F.KV_CACHE_DTYPES
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-cache-dtype", "int3"])


def test_the_kernels_lists_are_the_registry():
    """kernels.quant and kernels.block_quant name the formats they implement: the registry
    must name the same, in the same order; the torch page format reports registry names."""
    torch = pytest.importorskip("torch")
    from kvscope.engine.runner import page_format
    from kvscope.kernels import block_quant, quant

    assert quant.FORMATS == F.TOKEN_KV_CACHE_DTYPES
    assert tuple(block_quant.FORMATS) == F.BLOCK_KV_CACHE_DTYPES
    assert set(page_format._FLOAT_NAMES.values()) == {
        f.name for f in F.FORMATS if f.kind == F.FLOAT and not f.selectable}
    assert page_format.PageFormat("kivi4", torch.float32, 1, 16, 1, 64).is_block
