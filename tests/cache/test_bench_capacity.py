"""`kvscope bench capacity --hybrid` runs the whole engine on a tiny windowed model: at one
KV budget in bytes the hybrid cache runs more sequences at once, each holding fewer bytes,
than every layer keeping every block (the real numbers are in docs/benchmarks/models.md)."""

from __future__ import annotations

import json

from kvscope.engine.cli import main

# five windowed layers (W = 16) per global one, as Gemma 3's pattern
TINY_GEMMA3 = {
    "model_type": "gemma3_text", "num_hidden_layers": 6, "hidden_size": 32,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
    "intermediate_size": 64, "vocab_size": 300, "sliding_window": 16,
    "sliding_window_pattern": 6, "query_pre_attn_scalar": 16, "max_position_embeddings": 256,
}


def test_bench_capacity_hybrid_vs_keep_all(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_GEMMA3))
    argv = ["bench", "capacity", "--model", f"dummy:{config}", "--hybrid", "--prompt-len",
            "96", "--output-len", "4", "--num-requests", "6", "--budget-tokens", "256",
            "--max-model-len", "128", "--max-num-batched-tokens", "64", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    # 256 tokens of every layer hold two 100-token sequences when every block is kept
    assert out["keep_all_peak_running"] == 2
    assert out["hybrid_peak_running"] > out["keep_all_peak_running"]
    assert out["hybrid_kv_mib_per_seq"] < out["keep_all_kv_mib_per_seq"]
    assert out["prompt_len"] == 96 and out["output_len"] == 4
