"""Safe to serve (the issue's QA cases): a constraint the grammar engine cannot handle is
a 400 naming its field, with a short message that never quotes the grammar and no
traceback in the log, on every endpoint, streamed or not; a grammar compiles once, off
the event loop; admission (parsing, chat template, tokenizing) never runs on the event
loop, and a prompt whose bytes prove it too long is refused before tokenizing; and the
small API gaps (GET /v1/models/{id}, Responses cache_write_tokens)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import uuid

import openai
import pytest
from openai.types.responses.response_usage import ResponseUsage

from kvscope.engine import structured
from kvscope.engine.server import admission
from tests.server.asgi import InProcess

REGEX = "(a{1000}){1000}"  # QA: answered 500 with the grammar and the engine's state
SELF_REF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
MANY = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1500)}}


def _requests(kind: str, constraint: dict, stream: bool) -> tuple[str, dict, str]:
    """(url, body, the field holding the constraint) of each endpoint's way to send it."""
    schema = constraint.get("json")
    if kind == "completions":
        return "/v1/completions", {"prompt": "x", "max_tokens": 8, "temperature": 0,
                                   "stream": stream, "structured_outputs": constraint}, \
            "structured_outputs"
    msgs = [{"role": "user", "content": "x"}]
    if kind == "chat":
        return "/v1/chat/completions", {"messages": msgs, "max_tokens": 8, "temperature": 0,
                                        "stream": stream, "structured_outputs": constraint}, \
            "structured_outputs"
    fmt = {"type": "json_schema", "name": "x", "schema": schema}
    return "/v1/responses", {"input": "x", "max_output_tokens": 16, "temperature": 0,
                             "stream": stream, "text": {"format": fmt}}, "text"


def _error_of(r) -> dict:  # noqa: ANN001
    """The error a 4xx carries, or the one a stream's error event carries."""
    if r.status_code != 200:
        return r.json()["error"]
    for line in r.text.splitlines():
        if not line.startswith("data: {"):
            continue
        data = json.loads(line[6:])
        if isinstance(data.get("error"), dict):  # chat / completions
            return data["error"]
        if data.get("type") == "response.failed":  # the Responses API
            return data["response"]["error"]
    raise AssertionError(f"no error in {r.text[:500]}")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("kind", "constraint", "quoted"), [
    ("completions", {"regex": REGEX}, REGEX),
    ("chat", {"regex": REGEX}, REGEX),
    ("completions", {"json": SELF_REF}, '"$ref"'),
    ("chat", {"json": SELF_REF}, '"$ref"'),
    ("responses", {"json": SELF_REF}, '"$ref"'),
    ("completions", {"json": MANY}, "p1499"),
    ("responses", {"json": MANY}, "p1499"),
])
def test_a_grammar_the_engine_cannot_handle_is_a_400(served: InProcess, caplog, kind,
                                                     constraint, quoted, stream):
    url, body, field = _requests(kind, constraint, stream)
    with caplog.at_level(logging.INFO):
        r = served.http.post(url, json=body)
    err = _error_of(r)
    if not stream:
        assert r.status_code == 400, r.text[:500]
    if r.status_code == 400:
        assert err["param"] == field and err["type"] == "invalid_request_error"
    # a stream that started before the grammar failed ends with this error event instead
    assert "structured outputs" in err["message"] and len(err["message"]) < 300
    assert quoted not in err["message"] and "\n" not in err["message"]
    assert not any(rec.exc_info for rec in caplog.records)
    assert "Traceback" not in caplog.text
    # the engine serves everyone else
    ok = served.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_a_grammar_over_the_size_limit_is_refused_unbuilt(served: InProcess):
    before = structured._COMPILED.compiles
    r = served.http.post("/v1/completions", json={"prompt": "x", "structured_outputs":
                                                  {"json": MANY}})
    assert r.status_code == 400 and f"limit of {structured.MAX_GRAMMAR_BYTES}" in r.text
    assert structured._COMPILED.compiles == before


def test_a_slow_compile_is_a_400_and_never_blocks_the_loop(served: InProcess, monkeypatch):
    release = threading.Event()
    real = structured._CompiledGrammars._compile

    def slow(self, ll, text):  # noqa: ANN001, ANN202
        assert release.wait(60)
        return real(self, ll, text)

    monkeypatch.setattr(structured._CompiledGrammars, "_compile", slow)
    monkeypatch.setattr(structured, "MAX_COMPILE_S", 0.2)
    try:
        body = {"prompt": "x", "max_tokens": 2,
                "structured_outputs": {"regex": f"slow{uuid.uuid4().hex}"}}
        r = served.http.post("/v1/completions", json=body)
        assert r.status_code == 400 and "did not compile within 0.2 s" in r.text
        # meanwhile (the compile still stuck) the server answers others
        assert served.http.get("/health").status_code == 200
    finally:
        release.set()


def test_a_constraint_compiles_once(served: InProcess, monkeypatch):
    # Counted per grammar text: the process-wide counter also moves when an earlier test's
    # compile (left running on its own thread) finishes meanwhile.
    compiled: list[str] = []
    real = structured._CompiledGrammars._compile

    def counted(self, ll, text):  # noqa: ANN001, ANN202
        compiled.append(text)
        return real(self, ll, text)

    monkeypatch.setattr(structured._CompiledGrammars, "_compile", counted)
    regex = f"z{uuid.uuid4().hex[:6]}"
    body = {"prompt": "x", "max_tokens": 2, "temperature": 0,
            "structured_outputs": {"regex": regex}}
    for _ in range(3):
        assert served.http.post("/v1/completions", json=body).status_code == 200
    assert sum(regex in text for text in compiled) == 1


def test_admission_never_runs_on_the_event_loop(served: InProcess, monkeypatch):
    """Tokenizing, the chat template and grammar compiles run on worker threads."""
    on_loop: list[str] = []

    def watch(name, fn):  # noqa: ANN001, ANN202
        def wrapper(*a, **kw):  # noqa: ANN002, ANN003, ANN202
            try:
                asyncio.get_running_loop()
                on_loop.append(name)
            except RuntimeError:
                pass
            return fn(*a, **kw)
        return wrapper

    tok = served.state.tokenizer
    monkeypatch.setattr(tok, "encode", watch("encode", tok.encode))
    monkeypatch.setattr(structured.StructuredOutputsParams, "compile",
                        watch("compile", structured.StructuredOutputsParams.compile))
    from kvscope.engine.server import chat_prompt

    monkeypatch.setattr(chat_prompt.ChatPrompt, "prompt_text",
                        watch("template", chat_prompt.ChatPrompt.prompt_text))
    msgs = [{"role": "user", "content": "hi"}]
    for url, body in [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2,
                             "structured_outputs": {"choice": ["yes", "no"]}}),
        ("/v1/chat/completions", {"messages": msgs, "max_tokens": 2}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 16}),
        ("/tokenize", {"messages": msgs}),
    ]:
        assert served.http.post(url, json=body).status_code == 200, url
    assert on_loop == []


def _refused_as_too_long(served: InProcess, prompt: str) -> None:
    """Both text endpoints answer a too-long prompt with OpenAI's context_length_exceeded."""
    for url, body in [("/v1/completions", {"prompt": prompt}),
                      ("/v1/chat/completions", {"messages": [{"role": "user",
                                                              "content": prompt}]})]:
        r = served.http.post(url, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == \
            "context_length_exceeded", r.text


def test_an_obviously_oversized_prompt_is_refused_before_tokenizing(served: InProcess,
                                                                   monkeypatch):
    tok = served.state.tokenizer
    calls: list[int] = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, *a, **kw: calls.append(len(text)) or
                        real(text, *a, **kw))
    # (with this server's 64 KiB body limit, pretend tokens are at most 2 bytes long)
    monkeypatch.setattr(tok, "max_token_bytes", 2)
    limit = served.state.max_model_len * 2 * admission.SHRINK_ALLOWANCE
    big = "word " * (limit // 5 + 10)
    _refused_as_too_long(served, big)
    assert calls == []
    # the real longest token of this vocabulary: a bound no shorter text can break
    monkeypatch.undo()
    assert tok.max_token_bytes >= max(
        len(tok.decode([i]).encode()) for i in range(0, tok.backend.get_vocab_size(), 97))


def test_a_long_prompt_is_refused_on_a_probe_of_its_start(served: InProcess, monkeypatch):
    """Past the byte bound's reach, a long prompt is judged by tokenizing its start only:
    six 3 MB prompts tokenized whole took the cores from the running streams."""
    tok = served.state.tokenizer
    calls: list[int] = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text, *a, **kw: calls.append(len(text)) or
                        real(text, *a, **kw))
    probe = served.state.max_model_len * admission.PROBE_CHARS_PER_TOKEN
    big = "word " * (probe // 5 + 1000)  # about a token a word: over twice the context
    _refused_as_too_long(served, big)
    assert calls == [probe, probe]
    # a long prompt the probe cannot judge (few tokens at its start) is counted whole:
    # a tokenizer whose tokens here are 100 characters long
    calls.clear()
    monkeypatch.setattr(tok, "encode", lambda text, *a, **kw: calls.append(len(text)) or
                        [1] * (len(text) // 100))
    sparse = "word " * (probe // 5 + 1000)
    r = served.http.post("/v1/completions", json={"prompt": sparse, "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert calls == [probe, len(sparse)]


def test_models_retrieve(served: InProcess):
    client = served.openai()
    name = served.state.settings.served_model_name
    m = client.models.retrieve(name)
    assert m.id == name and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_responses_usage_counts_the_prompt_tokens_written_to_the_cache(served: InProcess):
    words = " ".join(uuid.uuid4().hex for _ in range(6))  # a prompt no earlier test sent
    body = {"input": f"Repeat: {words}", "max_output_tokens": 16, "temperature": 0}
    first = served.http.post("/v1/responses", json=body).json()["usage"]
    ResponseUsage.model_validate(first)  # what the openai client's types require
    d = first["input_tokens_details"]
    bs = 16  # the served engine's block size (conftest.SHARED: 96 blocks x 16)
    assert 0 < d["cache_write_tokens"] <= first["input_tokens"] - d["cached_tokens"]
    assert d["cache_write_tokens"] % bs == 0
    again = served.http.post("/v1/responses", json=body).json()["usage"]
    d2 = again["input_tokens_details"]
    assert d2["cache_write_tokens"] == 0  # found cached, written by the first
    # all of it, up to what a hit may cover: every whole block but the one holding the
    # prompt's last token, which is always computed (a prompt of a whole number of
    # blocks, 1 in 16 of these random ones, writes its last block but cannot hit it)
    hittable = (first["input_tokens"] - 1) // bs * bs
    assert d2["cached_tokens"] >= min(d["cached_tokens"] + d["cache_write_tokens"], hittable)
