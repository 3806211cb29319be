"""`kvscope serve --disk-cache-dir DIR --disk-cache-size 20GiB` becomes the engine config;
a bad size or a disk tier without a host tier is refused before anything loads."""

from __future__ import annotations

import argparse
import logging
from types import SimpleNamespace

import pytest

from kvscope.engine.cli import build_parser
from kvscope.engine.commands.serve import engine_config, model_of, parse_size
from kvscope.engine.config import EngineConfig
from kvscope.engine.runner import kv_budget


def config(*flags: str) -> EngineConfig:
    args = build_parser().parse_args(["serve", "dummy:tiny", *flags])
    args.model = model_of(args)
    return engine_config(args)


def test_flags_reach_the_config(tmp_path):
    cfg = config("--swap-space", "0.01", "--disk-cache-dir", str(tmp_path),
                 "--disk-cache-size", "20GiB")
    assert cfg.disk_cache_dir == str(tmp_path) and cfg.disk_cache_size == 20 << 30
    assert config().disk_cache_dir is None  # off by default


def test_bad_size_and_missing_host_tier_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--disk-cache-size", "lots"])
    with pytest.raises(ValueError, match="swap_space"):
        config("--disk-cache-dir", str(tmp_path), "--disk-cache-size", "1GiB")
    with pytest.raises(ValueError, match="disk_cache_size"):
        config("--swap-space", "0.01", "--disk-cache-dir", str(tmp_path))


@pytest.mark.parametrize("size", ["99999999999999999999GiB", "9" * 400, "2EiB", "1e9GiB",
                                  "2000000TiB"])
def test_absurd_sizes_are_a_clear_error_not_a_traceback(size, capsys):
    """Build 5 of issue 49: an absurd size ended in an OverflowError traceback (or was
    taken as is and overflowed later); now argparse's usage error says what a size is."""
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(size)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--disk-cache-size", size])
    err = capsys.readouterr().err
    assert "--disk-cache-size" in err and "Traceback" not in err


def test_sizes_parse_exactly():
    assert parse_size("20TiB") == 20 << 40 and parse_size("1.5 GiB") == 3 << 29
    assert parse_size("500MB") == 500 * 10**6 and parse_size("4096") == 4096
    assert parse_size("1.") == 1 and parse_size("0.5KiB") == 512


def test_a_20_tib_budget_is_capped_to_a_bounded_pool(caplog):
    """20 TiB of smollm2-sized block files is ~30M blocks, whose per-block bookkeeping
    (the disk pool's lists) cost over 1 GB at start-up; the tier is capped at the largest
    pool an event mirror takes, with a warning."""
    cfg = SimpleNamespace(disk_cache_dir="/x", disk_cache_size=20 << 40, block_size=16)
    fmt = SimpleNamespace(bytes_per_block=737_280)
    with caplog.at_level(logging.WARNING):
        assert kv_budget.num_disk_blocks(cfg, fmt) == kv_budget.MAX_DISK_BLOCKS
    assert "holds at most" in caplog.text
    small = SimpleNamespace(disk_cache_dir="/x", disk_cache_size=20 << 30, block_size=16)
    assert kv_budget.num_disk_blocks(small, fmt) < kv_budget.MAX_DISK_BLOCKS
