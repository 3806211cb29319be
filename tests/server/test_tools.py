"""Function calling through the official openai client: a named function or "required"
holds the answer to the tools' schemas and returns it as tool_calls, streamed or not; "auto"
and malformed tool requests are 400s naming the field; a conversation that carries earlier
tool calls and tool results is accepted."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.asgi import InProcess

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False,
                   "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 20},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "additionalProperties": False,
                                  "required": ["a", "b"],
                                  "properties": {"a": {"type": "integer"},
                                                 "b": {"type": "integer"}}}}}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(served: InProcess) -> openai.OpenAI:
    return served.openai()


def _fits(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    else:
        assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())


def test_a_named_function_is_called_with_arguments_of_its_schema(client):
    r = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0.8, seed=1,
        n=2, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for choice in r.choices:
        msg = choice.message
        assert msg.content is None and len(msg.tool_calls) == 1, msg
        call = msg.tool_calls[0]
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert call.function.name == "get_weather"
        _fits("get_weather", call.function.arguments)
        assert choice.finish_reason == "stop"


def test_required_calls_one_or_more_of_the_tools(client):
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS,
                                       tool_choice="required", max_tokens=120, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop" and calls
    for call in calls:
        _fits(call.function.name, call.function.arguments)


def test_parallel_tool_calls_false_makes_one_call(client):
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=120, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1, calls
    _fits(calls[0].function.name, calls[0].function.arguments)


def test_a_named_function_streams_its_arguments(client):
    stream = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, max_tokens=40, temperature=0,
        tool_choice={"type": "function", "function": {"name": "add"}}, stream=True)
    ids, names, arguments = set(), set(), ""
    for chunk in stream:
        for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            assert tc.index == 0
            ids |= {tc.id} if tc.id else set()
            names |= {tc.function.name} if tc.function.name else set()
            arguments += tc.function.arguments or ""
    assert len(ids) == 1 and names == {"add"}
    _fits("add", arguments)


def test_required_streams_each_call_once_it_closes(client):
    kw = dict(model="smollm2", messages=ASK, tools=TOOLS, tool_choice="required",
              max_tokens=120, temperature=0.8, seed=5)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    streamed: dict[int, dict] = {}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            assert tc.index not in streamed  # each call whole, once
            streamed[tc.index] = {"name": tc.function.name, "arguments": tc.function.arguments}
    assert [streamed[i] for i in range(len(streamed))] == \
        [{"name": c.function.name, "arguments": c.function.arguments} for c in whole]


def test_a_conversation_with_earlier_calls_and_results(client):
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call1", "content": "18 degrees, sunny"}]
    r = client.chat.completions.create(model="smollm2", messages=turn, max_tokens=8,
                                       tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": TOOLS}, "tool_choice"),  # OpenAI's default with tools is "auto"
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "wat"}}}], "tool_choice": "required"}, "tools"),
])
def test_what_cannot_be_done_is_refused_by_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2", messages=ASK, max_tokens=4, **extra)
    assert e.value.body["param"] == param, e.value.body


def test_completions_take_no_tools(served: InProcess):
    r = served.http.post("/v1/completions",
                         json={"prompt": "x", "tools": TOOLS, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
