"""Structured outputs in the engine (engine.structured): what a constrained completion
produces parses and fits its constraint, the paged engine equals plain generation under the
same constraint (greedy and seeded, with preemption), and neighbours in the batch are
untouched."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvscope.engine.reference_generate import generate_reference
from kvscope.engine.sampling_ops import sample
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.structured import StructuredOutputsParams
from tests.engine.conftest import GREEDY, PROMPTS, TEST_MODEL, as_prompt, prompt_ids, run_all

pytestmark = pytest.mark.skipif(TEST_MODEL.startswith("dummy"),
                                reason="structured outputs need the model's tokenizer")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
ASK = "Describe a person as JSON with a name and an age:\n"


def _params(constraint: StructuredOutputsParams, **kw: object) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 48,
                             "structured_outputs": constraint, **kw})


def _fits_person(text: str) -> None:
    obj = json.loads(text)
    assert text == json.dumps(obj, ensure_ascii=False), text  # compact: JSON_LAYOUT
    assert set(obj) == {"name", "age"} and isinstance(obj["name"], str)
    assert len(obj["name"]) <= 12 and isinstance(obj["age"], int) and 0 <= obj["age"] <= 120


def test_json_schema_regex_and_choice_hold(make_engine, loaded):
    eng = make_engine()
    cases = {
        "schema": (ASK, _params(StructuredOutputsParams(json=PERSON)), _fits_person),
        "object": (ASK, _params(StructuredOutputsParams(json_object=True)),
                   lambda t: isinstance(json.loads(t), dict)),
        "regex": ("My phone number is", _params(StructuredOutputsParams(regex=r"\d{3}-\d{4}")),
                  lambda t: re.fullmatch(r"\d{3}-\d{4}", t) or pytest.fail(t)),
        "choice": ("Is the sky blue? Answer:",
                   _params(StructuredOutputsParams(choice=["yes (sure)", "no.", "a.b"])),
                   lambda t: t in ("yes (sure)", "no.", "a.b") or pytest.fail(t)),
    }
    for rid, (prompt, params, _) in cases.items():
        eng.add_request(rid, as_prompt(loaded, prompt), params)
    out = run_all(eng)
    for rid, (_, _, check) in cases.items():
        done = out[rid].outputs[0]
        check(done.text)
        assert done.finish_reason == "stop", (rid, done.text)


def test_paged_engine_equals_plain_generation_under_a_grammar(make_engine, loaded):
    """Greedy and seeded tempered (n=2), with a pool small enough to preempt: the same
    tokens as contiguous generation with the same constraint (one CompletionState and one
    sampler for both)."""
    model, tok, cfg = loaded
    constraint = StructuredOutputsParams(json=PERSON)
    params = [_params(constraint), _params(constraint, temperature=0.9, seed=7, n=2)]
    ids = prompt_ids(tok, ASK, cfg.vocab_size)
    want = [[generate_reference(model, tok, ids, p, index=i).token_ids for i in range(p.n)]
            for p in params]
    eng = make_engine(block_size=4, num_gpu_blocks=10, watermark=0.0)
    for i, p in enumerate(params):
        eng.add_request(str(i), {"prompt_token_ids": ids}, p)
    out = run_all(eng)
    assert eng.scheduler.num_preemptions > 0
    for i in range(len(params)):
        got = [o.token_ids for o in out[str(i)].outputs]
        assert got == want[i]
        for o in out[str(i)].outputs:
            _fits_person(o.text)


def test_unconstrained_neighbours_are_untouched(make_engine, loaded, reference):
    eng = make_engine()
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"plain{i}", as_prompt(loaded, p), GREEDY)
    eng.add_request("json", as_prompt(loaded, ASK), _params(StructuredOutputsParams(json=PERSON)))
    out = run_all(eng)
    assert [out[f"plain{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == \
        [reference[p] for p in PROMPTS]
    _fits_person(out["json"].outputs[0].text)


def test_the_grammar_ends_the_completion_before_min_tokens(make_engine, loaded):
    """min_tokens bans EOS, but a complete grammar allows nothing else: the grammar wins
    and the completion stops, instead of sampling from an empty distribution."""
    eng = make_engine()
    eng.add_request("0", as_prompt(loaded, "Is the sky blue? Answer:"),
                    _params(StructuredOutputsParams(choice=["yes", "no"]), min_tokens=5))
    done = run_all(eng)["0"].outputs[0]
    assert done.text in ("yes", "no") and done.finish_reason == "stop"


def test_sample_masks_by_allowed_and_lets_the_grammar_win_over_bans():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
    greedy = [SamplingParams(temperature=0.0)]
    only_2_3 = [torch.tensor([False, False, True, True])]
    assert sample(logits, greedy, [None], allowed=only_2_3)[0].item() == 2
    assert sample(logits, greedy, [None], [{2}], only_2_3)[0].item() == 3
    # banning everything the grammar allows: the grammar's mask alone applies
    assert sample(logits, greedy, [None], [{2, 3}], only_2_3)[0].item() == 2
    # logprobs stay the raw model's
    _, lp = sample(logits, greedy, [None], allowed=only_2_3)
    assert lp.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 2].item())


@pytest.mark.parametrize("kwargs", [{}, {"json": {}, "regex": "a"},
                                    {"choice": []}, {"choice": ["a", ""]}])
def test_exactly_one_constraint(kwargs):
    with pytest.raises(ValueError):
        StructuredOutputsParams(**kwargs)


def test_a_bad_constraint_is_a_value_error_at_add(make_engine, loaded):
    eng = make_engine()
    bad = _params(StructuredOutputsParams(json={"type": "nonsense"}))
    with pytest.raises(ValueError, match="structured outputs"):
        eng.add_request("bad", as_prompt(loaded, ASK), bad)
    assert not eng.has_unfinished_requests()


def test_max_calls_bounds_a_required_answer(loaded):
    """tool_choice "required" (engine.server.tools): an array of calls; at most max_calls
    of them (1 for parallel_tool_calls false, the Responses API's max_tool_calls)."""
    from kvscope.engine.server.tools import constraint
    from kvscope.engine.structured import GrammarMatcher

    tok = loaded[1]
    fns = [{"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}}]
    two = '[{"name": "f", "parameters": {"x": 1}}, {"name": "f", "parameters": {"x": 2}}]'
    for most, accepted in ((None, True), (1, False), (2, True)):
        m = GrammarMatcher(constraint(fns, "required", max_calls=most), tok)
        try:
            for t in tok.encode(two, add_special_tokens=False):
                m.accept(t)
            ok = True
        except ValueError:
            ok = False
        assert ok is accepted


def test_objects_admit_only_their_listed_properties_unless_they_say_otherwise(loaded):
    """As vLLM's default backend (xgrammar's strict mode) and OpenAI's strict schemas: a
    pydantic-style schema without additionalProperties gets no extra keys (a small model
    held to an open object keeps adding keys until max_tokens); one that allows them,
    nested or not, keeps them."""
    from kvscope.engine.structured import GrammarMatcher

    tok = loaded[1]
    inner = {"type": "object", "properties": {"n": {"type": "integer"}}}
    pydantic_like = {"type": "object", "required": ["a"], "properties": {
        "a": {"type": "integer"}, "b": {"type": "array", "items": inner}}}
    texts = {"extra key": '{"a": 1, "zz": 2}', "nested extra": '{"a": 1, "b": [{"n": 1, "m": 2}]}',
             "listed only": '{"a": 1, "b": [{"n": 1}]}'}

    def accepts(schema: dict, text: str) -> bool:
        m = GrammarMatcher(StructuredOutputsParams(json=schema), tok)
        try:
            for t in tok.encode(text, add_special_tokens=False):
                m.accept(t)
        except ValueError:
            return False
        return True

    assert not accepts(pydantic_like, texts["extra key"])
    assert not accepts(pydantic_like, texts["nested extra"])
    assert accepts(pydantic_like, texts["listed only"])
    open_ = {**pydantic_like, "additionalProperties": True,
             "properties": {**pydantic_like["properties"],
                            "b": {"type": "array", "items": {**inner,
                                                             "additionalProperties": True}}}}
    assert accepts(open_, texts["extra key"]) and accepts(open_, texts["nested extra"])
