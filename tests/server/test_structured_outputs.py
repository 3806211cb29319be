"""Structured outputs over HTTP, as clients send them: OpenAI's ``response_format``
(json_object, json_schema) through the official client, streamed and not, and vLLM's
``structured_outputs`` (regex, choice) on completions. What comes back parses and fits."""

from __future__ import annotations

import json
import re

import openai

from tests.server.asgi import InProcess

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
ASK = [{"role": "user", "content": "Describe a person as JSON with a name and an age."}]


def _client(served: InProcess) -> openai.OpenAI:
    return served.openai()


def _fits_person(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"name", "age"} and isinstance(obj["name"], str), obj
    assert isinstance(obj["age"], int) and 0 <= obj["age"] <= 120, obj


def test_response_format_json_schema_and_json_object(served: InProcess):
    client = _client(served)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    r = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=48,
                                       temperature=0.7, seed=3, n=2, response_format=fmt)
    for choice in r.choices:
        _fits_person(choice.message.content)
        assert choice.finish_reason == "stop"
    stream = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=48,
                                            temperature=0, response_format=fmt, stream=True)
    _fits_person("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
    r = client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=48,
                                       temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_vllm_structured_outputs_on_completions(served: InProcess):
    url = "/v1/completions"
    r = served.http.post(url, json={"prompt": "My phone number is", "max_tokens": 12,
                                    "temperature": 0,
                                    "structured_outputs": {"regex": r"\d{3}-\d{4}"}})
    assert r.status_code == 200, r.text
    assert re.fullmatch(r"\d{3}-\d{4}", r.json()["choices"][0]["text"])
    r = served.http.post(url, json={"prompt": ["Is the sky blue? Answer:",
                                               "Is fire cold? Answer:"],
                                    "max_tokens": 4, "temperature": 0,
                                    "structured_outputs": {"choice": ["yes", "no"]}})
    assert r.status_code == 200, r.text
    assert {c["text"] for c in r.json()["choices"]} <= {"yes", "no"}
    bad = served.http.post(url, json={"prompt": "x", "structured_outputs": {
        "json": {"type": "object", "properties": {"a": {"type": "wat"}}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "structured_outputs"
    assert served.http.post(url, json={"prompt": "x", "max_tokens": 1}).status_code == 200
