"""``stand-in:MODEL`` is a model name: MODEL's config and tokenizer, a forward that sleeps
instead of computing (engine.model.stand_in), loaded through the one ``load_model`` path
(no module is patched at run time)."""

from __future__ import annotations

from kvscope.engine.model import load_model, read_config
from kvscope.engine.model.stand_in import StandInModel, StepCost


def test_stand_in_name_loads_the_target_config_without_weights():
    model, tokenizer, config = load_model("stand-in:dummy:tiny")
    assert isinstance(model, StandInModel)
    assert tokenizer is None  # dummy models have none, so neither has their stand-in
    assert config == read_config("dummy:tiny")[1]
    assert read_config("stand-in:dummy:tiny")[1] == config


def test_stand_in_engine_answers_with_its_words():
    from kvscope.engine import LLM, SamplingParams

    llm = LLM("stand-in:dummy:tiny", num_gpu_blocks=32, block_size=4)
    llm.llm_engine.model.cost = StepCost(0.0, 0.0, 0.0)  # no sleeping in a test
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       SamplingParams(max_tokens=4, temperature=0))[0].outputs[0]
    # the invariant of StandInModel: after token t at position p comes words[(t + p) % 3]
    words = [7, 8, 9]
    expected, prev, pos = [], 3, 2
    for _ in range(4):
        prev = words[(prev + pos) % 3]
        expected.append(prev)
        pos += 1
    assert out.token_ids == expected
