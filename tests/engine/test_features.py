"""The features table (engine.features): every row refuses (or falls back) with its
reason, where the config, the model or the runner decides; docs/kv-cache.md lists the
code's rows."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvscope.engine import features as F
from kvscope.engine.config import EngineConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "kv-cache.md"

# a config that turns each config feature on (a later feature's values win)
CONFIG = {
    "kv_demotion": {"kv_demotion": "int8"},
    "quantized kv_cache_dtype": {"kv_cache_dtype": "int8"},
    "block format": {"kv_cache_dtype": "kivi4"},
    "swap space": {"swap_space": 1.0},
    "no swap space": {"swap_space": 0.0},
    "contiguous layout": {"kv_layout": "contiguous"},
    "disk tier": {"disk_cache_dir": "/nonexistent/kv", "disk_cache_size": 1 << 20,
                  "swap_space": 1.0},
    "no prefix caching": {"enable_prefix_caching": False},
    "tensor parallelism": {"tensor_parallel_size": 2},
}
# a model config that turns each model feature on
MODEL = {
    "sliding-window layers": {"windowed": True},
    "hybrid KV cache": {"windowed": True},
    "gemma3_text": {"architecture": "gemma3_text"},
}
RUNNER = {"CUDA graphs", "not the LlamaModel forward"}  # the runner's own facts


def model_config(**kw) -> SimpleNamespace:
    return SimpleNamespace(**{"windowed": False, "architecture": "llama", **kw})


def _doc_rows() -> list[tuple[str, str, str, str]]:
    section = DOC.read_text().split("## What combines", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    cells = [tuple(c.strip() for c in line.strip("|").split(" | ")) for line in rows]
    assert cells[0] == ("feature", "feature", "outcome", "reason")
    return cells[1:]


def test_the_doc_lists_the_code_rows():
    assert _doc_rows() == [(c.a, c.b, c.outcome, c.reason) for c in F.CLASHES]


def test_the_table_is_well_formed():
    assert set(CONFIG) | set(MODEL) | RUNNER == set(F.FEATURES)
    pairs = [frozenset((c.a, c.b)) for c in F.CLASHES]
    assert len(set(pairs)) == len(pairs) and all(len(p) == 2 for p in pairs)
    assert {c.outcome for c in F.CLASHES} == {F.REFUSE, F.FALLBACK}
    assert all(c.a in F.FEATURES and c.b in F.FEATURES for c in F.CLASHES)


def _refusals(where: str) -> list[F.Clash]:
    rows = F.clashes(set(F.FEATURES), F.REFUSE)
    if where == "config":
        return [c for c in rows if c.a in CONFIG and c.b in CONFIG]
    return [c for c in rows if c.a in MODEL or c.b in MODEL]


@pytest.mark.parametrize("clash", _refusals("config"), ids=lambda c: f"{c.a}+{c.b}")
def test_each_config_row_refuses_with_its_reason(clash):
    kw = {**CONFIG[clash.a], **CONFIG[clash.b]}
    with pytest.raises(ValueError) as err:
        EngineConfig(**kw)
    assert str(err.value) == f"invalid engine config: {clash.a} and {clash.b} do not " \
                             f"combine: {clash.reason}"
    EngineConfig(**CONFIG[clash.a])  # each alone is fine
    if clash.b != "no swap space":  # "disk tier" alone brings its swap space
        EngineConfig(**CONFIG[clash.b])


@pytest.mark.parametrize("clash", _refusals("model"), ids=lambda c: f"{c.a}+{c.b}")
def test_each_model_row_refuses_with_its_reason(clash):
    config = EngineConfig(**CONFIG.get(clash.a, {}), **CONFIG.get(clash.b, {}))
    mc = model_config(**MODEL.get(clash.a, {}), **MODEL.get(clash.b, {}))
    with pytest.raises(ValueError, match=re.escape(clash.message())) as err:
        F.check_model(config, mc)
    assert str(err.value).startswith(f"{mc.architecture}: ")
    F.check_model(EngineConfig(), mc)  # the model alone is fine
    F.check_model(config, model_config())  # the config alone too


def test_every_refusal_is_tested():
    assert len(_refusals("config")) + len(_refusals("model")) == \
        len(F.clashes(set(F.FEATURES), F.REFUSE))


@pytest.mark.parametrize("clash", F.clashes(set(F.FEATURES), F.FALLBACK),
                         ids=lambda c: f"{c.a}+{c.b}")
def test_each_fallback_row_switches_its_first_feature_off(clash):
    assert F.fallbacks({clash.a, clash.b}, clash.a) == [clash]
    assert F.fallbacks({clash.a}, clash.a) == []
    assert clash.reason.endswith(("every layer keeps every block", "decode runs eagerly"))


@pytest.mark.parametrize("other", ["disk tier", "contiguous layout", "tensor parallelism"])
def test_the_hybrid_cache_falls_back_where_the_table_says(other, caplog):
    from kvscope.engine.runner.kv_budget import hybrid_applies

    windowed = model_config(windowed=True)
    assert hybrid_applies(EngineConfig(), windowed)
    assert not hybrid_applies(EngineConfig(disable_hybrid_kv_cache_manager=True), windowed)
    config = EngineConfig(**CONFIG[other])
    assert not hybrid_applies(config, windowed)
    assert [c.b for c in F.check_model(config, windowed) if c.a == "hybrid KV cache"] == \
        [other]


def test_the_runner_decides_cuda_graphs_from_the_table():
    """The runner's facts as built (engine.runner.model_runner): graphs only when no
    fallback row applies."""
    assert not F.fallbacks({"CUDA graphs"}, "CUDA graphs")
    for other in ("kv_demotion", "block format", "hybrid KV cache",
                  "not the LlamaModel forward"):
        assert [c.b for c in F.fallbacks({"CUDA graphs", other}, "CUDA graphs")] == [other]
