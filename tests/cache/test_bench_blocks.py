"""`kvscope bench blocks` runs end to end and prints every number (tiny sizes; the real
numbers are in docs/BENCHMARKS.md)."""

from __future__ import annotations

import json

from kvscope.engine.cli import main


def test_bench_blocks_json(capsys):
    argv = ["bench", "blocks", "--blocks", "2000", "--seqs", "4", "--decode-tokens", "512",
            "--matches", "2", "--repeat", "1", "--events", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    for suffix in ("", "_events"):
        for key in ("alloc_free_seq_per_s", "alloc_free_with_add_seq_per_s",
                    "decode_slot_tok_per_s", "decode_slot_and_append_tok_per_s",
                    "prefix_match_4k_us_revive", "prefix_match_4k_us_in_use"):
            assert out[key + suffix] > 0, key + suffix
    assert out["blocks"] == 2000 and out["block_size"] == 16
