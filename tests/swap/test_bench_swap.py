"""`kvscope bench swap` runs end to end on CPU and prints every number (tiny sizes; the
real numbers are in docs/BENCHMARKS.md)."""

from __future__ import annotations

import json

from kvscope.engine.cli import main


def test_bench_swap_json(capsys):
    argv = ["bench", "swap", "--pool-blocks", "16", "--swap-blocks", "6",
            "--prefix-tokens", "40", "--block-size", "8", "--repeat", "1", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("swap_out_gb_s", "swap_in_gb_s", "copy_out_gb_s", "copy_in_gb_s",
                "ttft_host_hit_s", "ttft_recompute_s", "ttft_device_hit_s"):
        assert out[key] > 0, key
    assert out["bytes"] == 6 * out["bytes_per_block"]
    assert out["host_hit_tokens"] == 40 and out["recompute_hit_tokens"] == 0
