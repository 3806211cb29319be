"""The OpenAI-compatible endpoints over the real engine (in process, through ASGI), through
the `openai` client and plain HTTP: completions and chat, streaming and not, usage with
cached tokens, /v1/models, /health and a /metrics page that prometheus-client parses."""

from __future__ import annotations

import json

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.asgi import InProcess

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(served: InProcess) -> openai.OpenAI:
    return served.openai()


def test_chat_non_streaming_answers(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=8,
                                       temperature=0)
    assert r.object == "chat.completion" and r.model == "smollm2"
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 10 and 1 <= u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    """Greedy: the streamed deltas concatenate to the same text; usage comes last; the
    second identical prompt is served from the prefix cache."""
    plain = client.chat.completions.create(messages=QUESTION, model="smollm2", max_tokens=6,
                                           temperature=0)
    stream = client.chat.completions.create(messages=QUESTION, model="smollm2", max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == plain.choices[0].finish_reason and not any(finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    usage = chunks[-1].usage
    assert usage.completion_tokens == plain.usage.completion_tokens
    # Same prompt again: every full block of it is a prefix hit (the last token never is).
    block = 16
    assert usage.prompt_tokens_details.cached_tokens == \
        (usage.prompt_tokens - 1) // block * block


def test_completion_plain_http_and_openai_client(served: InProcess,
                                                 client: openai.OpenAI) -> None:
    r = served.http.post("/v1/completions", json={
        "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"].strip().startswith("Paris")
    assert body["usage"]["completion_tokens"] == 4
    assert body["choices"][0]["finish_reason"] == "length"
    c = client.completions.create(model="smollm2", prompt="The capital of France is",
                                  max_tokens=4, temperature=0)
    assert c.choices[0].text == body["choices"][0]["text"]


def test_completion_stream_sse_format_and_logprobs(served: InProcess) -> None:
    with served.http.stream("POST", "/v1/completions", json={
            "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
            "stream": True, "logprobs": 2}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == 3
    first = chunks[0]["choices"][0]["logprobs"]
    assert len(first["top_logprobs"][0]) == 2 and first["token_logprobs"][0] <= 0
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # text offsets run on across chunks and equal the non-streamed response's
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    whole = served.http.post("/v1/completions", json={
        "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0,
        "logprobs": 2}).json()["choices"][0]["logprobs"]
    assert whole["tokens"] == tokens and whole["text_offset"] == offsets
    assert offsets == [0, len(tokens[0]), len(tokens[0]) + len(tokens[1])]


def test_batch_prompts_n_and_stop(served: InProcess) -> None:
    r = served.http.post("/v1/completions", json={
        "prompt": ["One, two,", "Red, green,"], "n": 2, "max_tokens": 3, "temperature": 0.8,
        "seed": 1})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert all(c["finish_reason"] in ("stop", "length") for c in choices)
    assert 4 <= r.json()["usage"]["completion_tokens"] <= 12
    s = served.http.post("/v1/completions", json={
        "prompt": "Count: 1, 2, 3,", "max_tokens": 8, "temperature": 0, "stop": [" 5"]})
    text = s.json()["choices"][0]
    assert text["finish_reason"] == "stop" and " 5" not in text["text"] and "4" in text["text"]


def test_models_health_metrics(served: InProcess) -> None:
    """Runs after the tests above (file order): their repeated prompts made prefix hits."""
    models = served.http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["smollm2"]
    assert models["data"][0]["max_model_len"] == 2048
    assert served.http.get("/health").json()["status"] == "ok"
    text = served.http.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("kvscope:kv_cache_usage_perc", "kvscope:prefix_cache_queries",
                 "kvscope:prefix_cache_hits", "kvscope:num_preemptions",
                 "kvscope:num_requests_running", "kvscope:num_requests_waiting",
                 "kvscope:num_requests_swapped", "kvscope:swap_out_blocks",
                 "kvscope:swap_in_blocks", "kvscope:time_to_first_token_seconds",
                 "kvscope:time_per_output_token_seconds", "kvscope:prompt_tokens",
                 "kvscope:generation_tokens", "kvscope:request_success"):
        assert name in families, name
    assert families["kvscope:time_to_first_token_seconds"].type == "histogram"
    values = {s.name: s.value for f in families.values() for s in f.samples}
    assert values["kvscope:prefix_cache_hits_total"] > 0  # the repeated prompt above
    assert values["kvscope:time_to_first_token_seconds_count"] >= 1
    assert 0.0 <= values["kvscope:kv_cache_usage_perc"] <= 1.0
    assert values["kvscope:num_requests_running"] == 0


def test_chat_stream_n2_indexes_and_chat_logprobs(served: InProcess) -> None:
    with served.http.stream("POST", "/v1/chat/completions", json={
            "messages": QUESTION, "max_tokens": 2, "n": 2, "temperature": 1.0, "seed": 7,
            "stream": True, "logprobs": True, "top_logprobs": 1}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    finished = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks
                if c["choices"][0]["finish_reason"]}
    assert set(finished) == {0, 1}
    roles = [c["choices"][0]["index"] for c in chunks if "role" in c["choices"][0]["delta"]]
    assert sorted(roles) == [0, 1]  # each choice's first delta carries the role
    entries = [e for c in chunks for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert len(entries) == 4 and all(len(e["top_logprobs"]) == 1 for e in entries)
