"""The inspector on a stream from kvscope's vLLM plugin: the line above the views names
vLLM, its version, model and geometry, and what the plugin cannot see; kvscope's own
streams and hostile headers show no line (or only what is safe to show)."""

from __future__ import annotations

from kvscope.inspector.window import engine_line

VLLM_HEADER = {"engine": {"name": "vllm", "version": "0.32.0", "num_blocks": 24,
                          "block_size": 32, "data_parallel_rank": 0,
                          "unseen": ["KV moved by offloading connectors on the workers"]},
               "model": "/models/smollm2"}


def test_the_line_names_vllm_and_what_it_cannot_see():
    text = engine_line(VLLM_HEADER)
    assert "watching vLLM 0.32.0" in text and "/models/smollm2" in text
    assert "24 blocks x 32 tokens" in text and "null block" in text
    assert "not seen: KV moved by offloading connectors on the workers" in text


def test_kvscope_streams_and_odd_headers_show_no_line():
    assert engine_line({"engine": {"max_num_seqs": 8}, "model": "smollm2"}) == ""
    assert engine_line(None) == "" and engine_line({"engine": "vllm"}) == ""
    hostile = engine_line({"engine": {"name": "vllm", "version": "<b>x</b>",
                                      "num_blocks": [1], "unseen": [{"a": 1}]}})
    assert "<b>x</b>" not in hostile and "&lt;b&gt;" in hostile and "?" in hostile


def test_the_window_shows_the_line_for_a_vllm_recording(window):
    window.show_engine(VLLM_HEADER)
    assert window.engine_banner.isVisible() and "vLLM 0.32.0" in window.engine_banner.text()
    window.show_engine({"engine": {}})
    assert not window.engine_banner.isVisible()
