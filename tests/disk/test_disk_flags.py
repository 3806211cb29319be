"""`kvscope serve --disk-cache-dir DIR --disk-cache-size 20GiB` becomes the engine config;
a bad size or a disk tier without a host tier is refused before anything loads."""

from __future__ import annotations

import pytest

from kvscope.engine.cli import build_parser
from kvscope.engine.commands.serve import engine_config, model_of
from kvscope.engine.config import EngineConfig


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
