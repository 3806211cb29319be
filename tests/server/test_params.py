"""A request becomes the engine's SamplingParams in one pass (``to_sampling_params``): each
limit is checked once, and a refusal names the field the client sent, whatever name the
engine gives it; a structured request's grammar compiles once, for all its prompts and
completions; the request models stay importable without torch (the router reads them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvscope.engine.server.errors import APIError
from kvscope.engine.server.limits import Limits
from kvscope.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from kvscope.engine.server.responses_protocol import ResponsesRequest, responses_names
from kvscope.engine.server.strict import parse
from tests.server.asgi import InProcess
from tests.server.conftest import REPO
from tests.waiting import HANG_S

LIMITS = Limits(max_model_len=64, vocab_size=1000, max_n=4, max_logprobs=5)
HI = [{"role": "user", "content": "hi"}]


def _refused(model: type, body: dict, prompt_len: int = 8) -> APIError:
    req = parse(model, json.dumps(body).encode())
    with pytest.raises(APIError) as e:
        if model is ResponsesRequest:  # as the endpoint runs it: as a chat completion
            with responses_names():
                req.chat_request().to_sampling_params(prompt_len, LIMITS)
        else:
            req.to_sampling_params(prompt_len, LIMITS)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize(("model", "body", "param"), [
    (ChatCompletionRequest, {"messages": HI, "logprobs": True, "top_logprobs": -1},
     "top_logprobs"),  # the engine's logprobs
    (ChatCompletionRequest, {"messages": HI, "max_completion_tokens": 0},
     "max_completion_tokens"),  # the engine's max_tokens
    (ResponsesRequest, {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    (ResponsesRequest, {"input": "hi", "temperature": -1.0}, "temperature"),
    (CompletionRequest, {"prompt": "x", "echo": True, "logprobs": 2, "prompt_logprobs": -1},
     "prompt_logprobs"),  # the engine takes the larger of the two: the negative one names
    (CompletionRequest, {"prompt": "x", "logprobs": 6}, "logprobs"),  # --max-logprobs
    (CompletionRequest, {"prompt": "x", "logit_bias": {"1000": 1}}, "logit_bias"),  # vocab
    (CompletionRequest, {"prompt": "x", "stop_token_ids": [1000]}, "stop_token_ids"),
    (CompletionRequest, {"prompt": "x", "min_tokens": -1}, "min_tokens"),
    (CompletionRequest, {"prompt": "x", "n": 0}, "n"),
])
def test_a_refusal_names_the_field_the_client_sent(model, body, param):
    err = _refused(model, body)
    assert err.param == param and f"'{param}'" in err.message, err.message


def test_a_context_overflow_names_the_budget_or_the_prompt():
    err = _refused(CompletionRequest, {"prompt": "x", "max_tokens": 57})  # 8 + 57 > 64
    assert (err.param, err.code) == ("max_tokens", "context_length_exceeded")
    assert _refused(ResponsesRequest, {"input": "hi", "max_output_tokens": 57}).param == \
        "max_output_tokens"
    assert _refused(CompletionRequest, {"prompt": "x"}, prompt_len=64).param == "prompt"
    assert _refused(ChatCompletionRequest, {"messages": HI}, prompt_len=64).param == "messages"
    assert _refused(ResponsesRequest, {"input": "hi"}, prompt_len=64).param == "input"


def test_a_structured_request_compiles_its_grammar_once(served: InProcess, monkeypatch):
    """Two prompts, two completions each: four matchers, one compile (each completion
    starts from a copy of it)."""
    import llguidance

    from kvscope.engine import structured

    built = []
    real = llguidance.LLMatcher

    class Counting:  # LLMatcher, counting the matchers compiled (copies are not)
        def __call__(self, *a, **k):  # noqa: ANN002, ANN003, ANN204
            built.append(1)
            return real(*a, **k)

        def __getattr__(self, name: str):  # noqa: ANN204 - its static methods
            return getattr(real, name)

    monkeypatch.setattr(llguidance, "LLMatcher", Counting())
    # an empty grammar cache: an earlier test may have compiled this same choice
    monkeypatch.setattr(structured, "_COMPILED", structured._CompiledGrammars())
    r = served.http.post("/v1/completions", json={
        "prompt": ["Is the sky blue? Answer:", "Is fire cold? Answer:"], "n": 2,
        "max_tokens": 4, "temperature": 1.0, "seed": 3,
        "structured_outputs": {"choice": ["yes", "no"]}})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 4
    assert {c["text"] for c in r.json()["choices"]} <= {"yes", "no"}
    assert len(built) == 1


def test_the_request_models_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from kvscope.engine.server.protocol import ChatCompletionRequest\n"
            "from kvscope.engine.server.strict import parse\n"
            "from kvscope.engine.server.responses_protocol import ResponsesRequest\n"
            "parse(ChatCompletionRequest, b'{\"messages\": [{\"role\": \"user\", "
            "\"content\": \"hi\"}], \"response_format\": {\"type\": \"json_object\"}}')\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                       text=True, timeout=HANG_S, env=os.environ)
    assert r.returncode == 0, r.stderr
