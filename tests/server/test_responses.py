"""OpenAI's Responses API (/v1/responses) through the official openai client: the answer
equals the chat completion of the same conversation; streamed, the SDK's own stream
accumulator (which checks event order and item identities) rebuilds the same response;
structured text, function calls, logprobs and max_output_tokens behave as OpenAI's; what
kvscope cannot do (stored responses, hosted tools, images, tool_choice "auto") is a 400
naming the field, and the server keeps serving (the real engine, in process)."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel

from tests.server.asgi import InProcess

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "additionalProperties": False,
                          "required": ["city"],
                          "properties": {"city": {"type": "string", "maxLength": 20}}}}
ADD = {"type": "function", "name": "add",
       "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}


@pytest.fixture(scope="module")
def client(served: InProcess) -> openai.OpenAI:
    return served.openai()


def _events(served: InProcess, **body) -> list[dict]:
    """The raw SSE events of a streamed response (data lines, in order)."""
    out = []
    with served.http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                ev = json.loads(line[6:])
                assert ev["type"] == kind  # the SSE event name is the event's type
                out.append(ev)
    return out


def test_the_answer_is_the_chat_completion_of_the_same_conversation(client):
    r = client.responses.create(model="smollm2", instructions="You are a helpful assistant.",
                                input="What is the capital of France?", temperature=0,
                                max_output_tokens=120)
    chat = client.chat.completions.create(
        model="smollm2", temperature=0, max_completion_tokens=120,
        messages=[{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "What is the capital of France?"}])
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status == "completed" and r.error is None and r.incomplete_details is None
    assert r.output_text == chat.choices[0].message.content and r.output_text
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "You are a helpful assistant." and r.max_output_tokens == 120
    assert r.temperature == 0


def test_input_items_carry_roles_and_earlier_answers(client):
    items = [{"role": "developer", "content": "Be terse."},
             {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
             {"role": "user", "content": "Name a color."}]
    r = client.responses.create(model="smollm2", input=items, temperature=0,
                                max_output_tokens=20)
    chat = client.chat.completions.create(
        model="smollm2", temperature=0, max_completion_tokens=20,
        messages=[{"role": "system", "content": "Be terse."},
                  {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."},
                  {"role": "user", "content": "Name a color."}])
    assert r.output_text == chat.choices[0].message.content


def test_a_stream_rebuilds_the_same_response(client, served):
    kw = dict(model="smollm2", input="Say hello.", temperature=0, max_output_tokens=60)
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == deltas == whole.output_text
    assert final.status == whole.status == "completed"
    events = _events(served, **kw)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert events[-1]["response"]["output"] == done
    assert events[-1]["response"]["usage"]["output_tokens"] == whole.usage.output_tokens


def test_max_output_tokens_makes_the_response_incomplete(client, served):
    r = client.responses.create(model="smollm2", input="Tell me a long story.",
                                max_output_tokens=5, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete"
    events = _events(served, input="Tell me a long story.", max_output_tokens=5,
                     temperature=0)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_text_format_json_schema_parses_into_the_model(client):
    class City(BaseModel):
        name: str
        country: str

    r = client.responses.parse(model="smollm2", input="Paris is in France. Extract the city.",
                               text_format=City, temperature=0, max_output_tokens=60)
    assert r.status == "completed"
    assert isinstance(r.output_parsed, City) and r.output_parsed.name


def test_a_named_function_is_called_streamed_or_not(client):
    kw = dict(model="smollm2", input="What is the weather in Paris?", tools=[WEATHER, ADD],
              tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
              max_output_tokens=60)
    r = client.responses.create(**kw)
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"city"}
    with client.responses.stream(**kw) as stream:
        pieces = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    assert len(pieces) > 1  # the arguments stream piece by piece
    [streamed] = final.output
    assert streamed.arguments == "".join(pieces) == call.arguments


def test_required_calls_follow_the_schemas_and_max_tool_calls(client):
    r = client.responses.create(model="smollm2", input="What is the weather in Paris?",
                                tools=[WEATHER, ADD], tool_choice="required", temperature=0,
                                max_output_tokens=120, max_tool_calls=1)
    [call] = r.output
    assert call.type == "function_call" and call.name in ("get_weather", "add")
    json.loads(call.arguments)
    with client.responses.stream(model="smollm2", input="What is the weather in Paris?",
                                 tools=[WEATHER, ADD], tool_choice="required", temperature=0,
                                 max_output_tokens=120, max_tool_calls=1) as stream:
        final = stream.get_final_response()
    assert [(c.name, c.arguments) for c in final.output] == [(call.name, call.arguments)]


def test_a_conversation_with_a_tool_result_continues(client):
    r = client.responses.create(model="smollm2", temperature=0, max_output_tokens=30,
                                tools=[WEATHER], tool_choice="none", input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}])
    assert r.status in ("completed", "incomplete") and r.output[0].type == "message"


def test_logprobs_come_with_include(client):
    r = client.responses.create(model="smollm2", input="Hi", temperature=0,
                                max_output_tokens=3, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    lps = r.output[0].content[0].logprobs
    assert len(lps) == 3 and all(len(lp.top_logprobs) == 2 for lp in lps)
    assert "".join(lp.token for lp in lps) == r.output_text
    plain = client.responses.create(model="smollm2", input="Hi", temperature=0,
                                    max_output_tokens=3)
    assert plain.output[0].content[0].logprobs == []


@pytest.mark.parametrize(("body", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": []}, "input"),
    ({"tools": [WEATHER]}, "tool_choice"),  # no tool_choice: "auto"
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"truncation": "auto"}, "truncation"),
    ({"top_logprobs": 50, "include": ["message.output_text.logprobs"]}, "top_logprobs"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"max_tokens": 5}, "max_tokens"),  # chat's name: unknown here
])
def test_what_kvscope_cannot_do_is_a_400_naming_the_field(served, body, param):
    r = served.http.post("/v1/responses", json={"input": "Hi", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert served.http.get("/health").json()["status"] == "ok"
