"""The compatibility policy (README "Compatibility"): vLLM's extensions that clients send
are honoured, OpenAI fields that do not change the output are accepted and ignored, what
would change the output and is unsupported is a 400 naming the field; echo + logprobs
returns the prompt's logprobs (lm-eval's loglikelihood) and max_tokens 0 with echo
scores the prompt only."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.asgi import InProcess

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]

IGNORED = {"store": True, "metadata": {"team": "a"}, "service_tier": "auto", "user": "u1",
           "parallel_tool_calls": False, "response_format": {"type": "text"},
           "reasoning_effort": "low", "prompt_cache_key": "k", "safety_identifier": "s"}


def _post(served: InProcess, path: str, body: dict) -> httpx.Response:
    return served.http.post(path, json=body)


def test_ignored_fields_do_not_change_the_output(served: InProcess):
    base = {"messages": HI, "max_tokens": 6, "temperature": 0}
    plain = _post(served, CHAT, base)
    extra = _post(served, CHAT, base | IGNORED)
    assert plain.status_code == extra.status_code == 200, extra.text
    assert extra.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    cmpl = _post(served, CMPL, {"prompt": "x", "max_tokens": 2} | IGNORED)
    assert cmpl.status_code == 200, cmpl.text


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, {"messages": HI, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
    (CMPL, {"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs"),
    (CMPL, {"prompt": "x", "structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    (CMPL, {"prompt": "x", "structured_outputs": {"choice": ["a"]},
            "response_format": {"type": "json_object"}}, "structured_outputs"),
    (CMPL, {"prompt": "x", "guided_json": {}}, "guided_json"),  # vLLM's old name: unknown
    (CHAT, {"messages": HI, "tools": [{"type": "function"}]}, "tools"),
    (CHAT, {"messages": HI, "tool_choice": "auto"}, "tool_choice"),
    (CMPL, {"prompt": "x", "frequency_penalty": -3.0}, "frequency_penalty"),  # [-2, 2]
    (CMPL, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),  # > 0
    (CMPL, {"prompt": "x", "temprature": 0}, "temprature"),  # a typo: never ignored
    (CHAT, {"messages": HI, "prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_what_would_change_the_output_is_refused(served: InProcess, path, body, param):
    r = _post(served, path, body | {"max_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    if param == "guided_json":
        assert '"structured_outputs": {"json"' in r.json()["error"]["message"]


def test_assistant_prefill_and_no_op_tools(served: InProcess):
    """vLLM's continue_final_message: the prompt ends inside the assistant's message (no
    end-of-turn, no new turn header), so it is shorter than the default rendering; an empty
    tools list changes nothing; an image part is refused by name."""
    conv = [*HI, {"role": "assistant", "content": "Hello! My name is"}]
    base = {"messages": conv, "max_tokens": 4, "temperature": 0}
    opened = _post(served, CHAT, base)
    cont = _post(served, CHAT, base | {"add_generation_prompt": False,
                                       "continue_final_message": True})
    assert opened.status_code == cont.status_code == 200, cont.text
    assert cont.json()["usage"]["prompt_tokens"] < opened.json()["usage"]["prompt_tokens"]
    plain = _post(served, CHAT, {"messages": HI, "max_tokens": 6, "temperature": 0})
    tools = _post(served, CHAT, {"messages": HI, "max_tokens": 6, "temperature": 0,
                                 "tools": [], "tool_choice": "none"})
    assert tools.status_code == 200, tools.text
    assert tools.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    r = _post(served, CHAT, {"messages": image, "max_tokens": 1})
    assert r.status_code == 400 and "image_url" in r.json()["error"]["message"]


def test_continuous_usage_stats_put_usage_in_every_chunk(served: InProcess):
    body = {"prompt": "Hello", "max_tokens": 5, "ignore_eos": True, "min_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with served.http.stream("POST", CMPL, json=body) as r:
        assert r.status_code == 200
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines()
                  if ln.startswith("data: ") and ln != "data: [DONE]"]
    assert chunks and all("usage" in c for c in chunks)
    done = [c["usage"]["completion_tokens"] for c in chunks]
    assert done == sorted(done) and done[-1] == 5
    assert chunks[-1]["choices"] == []  # the final usage chunk


def test_echo_logprobs_cover_the_prompt(served: InProcess):
    prompt = "The capital of France is Paris"
    r = _post(served, CMPL, {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 1,
                             "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    usage = r.json()["usage"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == usage["prompt_tokens"] + 1
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp["token_logprobs"][1:])
    assert lp["text_offset"][0] == 0

    only = _post(served, CMPL, {"prompt": prompt, "max_tokens": 0, "echo": True,
                                "logprobs": 0, "temperature": 0})
    assert only.status_code == 200, only.text
    body = only.json()
    assert body["choices"][0]["text"] == prompt
    assert body["usage"]["completion_tokens"] == 0
    olp = body["choices"][0]["logprobs"]
    assert olp["token_logprobs"] == lp["token_logprobs"][:-1]  # the same numbers, no tail


def test_vllm_prompt_logprobs_field(served: InProcess):
    r = _post(served, CMPL, {"prompt": [1, 504, 3458, 282], "max_tokens": 1,
                             "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == 4
    assert "504" in plp[1] and all(set(v) == {"logprob", "rank", "decoded_token"}
                                   for v in plp[1].values())
    assert sorted(v["rank"] for v in plp[1].values() if v["rank"] is not None) == [1, 2]


def test_openapi_schema_names_the_request_models(served: InProcess):
    schema = served.http.get("/openapi.json").json()
    body = schema["paths"]["/v1/completions"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"]["$ref"].endswith("CompletionRequest")
    assert "prompt" in schema["components"]["schemas"]["CompletionRequest"]["properties"]


def test_penalties_and_logit_bias_reach_the_sampler(served: InProcess):
    """vLLM's repetition_penalty and OpenAI's frequency/presence penalties change what is
    sampled (greedy here, so any difference is theirs); a logit_bias of 100 on one token
    makes every token that one, and its reported logprob stays the model's own."""
    base = {"prompt": "def fibonacci(n):\n    ", "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    plain = _post(served, CMPL, base).json()["choices"][0]["text"]
    for extra in ({"repetition_penalty": 1.4},
                  {"frequency_penalty": 2.0, "presence_penalty": 2.0}):
        r = _post(served, CMPL, base | extra)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] != plain, extra
    ids = _post(served, "/tokenize", {"prompt": " banana", "add_special_tokens": False}
                ).json()["tokens"]
    r = _post(served, CMPL, base | {"max_tokens": 3, "logprobs": 0,
                                    "logit_bias": {str(ids[0]): 100}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [" banana"] * 3
    assert all(lp < -1 for lp in choice["logprobs"]["token_logprobs"])  # raw: unlikely
