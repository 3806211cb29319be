"""The LLM facade and reference generation on the real model: stops, seeds, n, errors."""

from __future__ import annotations

import pytest

from kvscope.engine import LLM, SamplingParams
from kvscope.engine.model.errors import ModelLoadError

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_answers_paris(llm):
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop" and out.finished
    assert out.prompt_token_ids == llm.get_tokenizer().apply_chat_template(QUESTION, tokenize=True)


def test_generate_accepts_text_and_token_ids(llm):
    params = SamplingParams(temperature=0, max_tokens=5)
    ids = llm.get_tokenizer().encode("The sky is")
    by_text, by_ids = llm.generate(["The sky is", {"prompt_token_ids": ids}], params,
                                   use_tqdm=False)
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    assert by_text.outputs[0].finish_reason == "length" and len(by_ids.outputs[0].token_ids) == 5
    assert by_text.request_id != by_ids.request_id


def test_stop_string_is_trimmed(llm):
    full = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)[0].outputs[0]
    assert " 7" in full.text
    out = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12, stop=" 7"),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == " 7"
    assert out.text == full.text[:full.text.index(" 7")]
    kept = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12, stop=" 7",
                                                      include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == out.text + " 7"


def test_stop_token_ids_and_ignore_eos(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24)
    first = llm.chat(QUESTION, greedy, use_tqdm=False)[0].outputs[0]
    stop_at = first.token_ids[2]
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24,
                                            stop_token_ids=[stop_at]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == first.token_ids[:3]
    assert out.outputs[0].stop_reason == stop_at
    longer = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                      use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) == 24 and longer.finish_reason == "length"
    assert longer.token_ids[:len(first.token_ids)] == first.token_ids


def test_seeded_sampling_is_reproducible_and_n_samples_differ(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=8, seed=123, n=3,
                            logprobs=2)
    a = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    b = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1
    c0 = a.outputs[0]
    assert len(c0.logprobs) == len(c0.token_ids)
    assert abs(sum(step[t] for step, t in zip(c0.logprobs, c0.token_ids, strict=True))
               - c0.cumulative_logprob) < 1e-4


def test_bad_requests_raise_clear_errors(llm):
    with pytest.raises(TypeError, match="a prompt is a str"):
        llm.generate([42], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"must lie in \[0, 49152\)"):
        llm.generate({"prompt_token_ids": [1, 99999]}, use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling params for 1 prompts"):
        llm.generate("hi", [SamplingParams(), SamplingParams()], use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len is 8192"):
        llm.generate({"prompt_token_ids": [5] * 8192}, use_tqdm=False)


def test_llm_rejects_unknown_arguments_and_bad_models(tmp_path):
    with pytest.raises(TypeError, match="unknown argument.*block_sise"):
        LLM("smollm2", block_sise=16)
    with pytest.raises(ModelLoadError, match="no such model"):
        LLM(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError, match="dtype must be"):
        LLM("smollm2", dtype="float8")
