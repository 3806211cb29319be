"""tool_choice "auto" end to end through the HTTP API, with a scripted engine (a simulated
test double, as SGLang's tests do: SmolLM2 never writes a tool call, so the answer is
scripted): the official openai client gets the calls the parser read out of the answer,
on chat and on the Responses API, streamed equal to unstreamed; the model is shown the
tools; an answer without calls is content; a server without a parser refuses "auto"."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.server.asgi import serve_double
from tests.server.doubles import CharTokenizer, SimulatedEngine

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _run(parser: str | None, pieces: list[str], call: Any) -> tuple[Any, SimulatedEngine]:
    """``call(client)`` with the official async client against the app, whose engine
    answers ``pieces``; its result (a stream's chunks or events, as a list)."""
    engine = SimulatedEngine(pieces)
    served = serve_double(engine, tokenizer=CharTokenizer(), max_model_len=4096,
                          vocab_size=1000, served_model_name="m", tool_parser=parser)

    async def go() -> Any:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=served.app))
        async with openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", max_retries=0,
                                      http_client=http) as client:
            out = await call(client)
            if hasattr(out, "__aiter__"):  # a stream: its chunks or events
                return [x async for x in out]
            return out

    try:
        return served.run(go()), engine
    finally:
        served.close()


def _chat(client, **kw):
    return client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], **kw)


async def _stream_chat(client):
    return await _chat(client, stream=True)


def _pieces(text: str, n: int = 7) -> list[str]:
    return [text[i:i + n] for i in range(0, len(text), n)]


def test_the_parser_reads_the_calls_out_of_a_chat_answer():
    answer = "Let me check.\n" + CALL
    r, engine = _run("hermes", [answer], lambda c: _chat(c, max_tokens=100))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert "<tools>" in "".join(chr(i) for i in engine.submitted[0].prompt_token_ids)


def test_streamed_chat_equals_unstreamed():
    answer = "Let me check.\n" + CALL
    stream, _ = _run("hermes", _pieces(answer), lambda c: _stream_chat(c))
    content = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    calls = [t for ch in stream if ch.choices for t in ch.choices[0].delta.tool_calls or ()]
    assert content == "Let me check.\n"
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        (0, "get_weather", {"city": "Paris"})]
    assert stream[-1].choices[0].finish_reason == "tool_calls"
    # the content went out before the call was complete
    first_content = next(i for i, ch in enumerate(stream) if ch.choices and
                         ch.choices[0].delta.content)
    assert first_content < len(stream) - 1


def test_an_answer_without_calls_is_content():
    r, _ = _run("hermes", ["It is sunny."], lambda c: _chat(c, max_tokens=100))
    assert r.choices[0].message.content == "It is sunny."
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "stop"


def test_the_responses_api_gets_the_calls_after_the_content():
    answer = "Checking.\n" + CALL
    tool = {"type": "function", **WEATHER["function"]}

    def create(c, **kw):
        return c.responses.create(model="m", input="Weather in Paris?", tools=[tool], **kw)

    r, _ = _run("hermes", [answer], create)
    assert [o.type for o in r.output] == ["message", "function_call"]
    assert r.output[0].content[0].text == "Checking.\n"
    assert r.output[1].name == "get_weather" and json.loads(r.output[1].arguments) == {
        "city": "Paris"}
    events, _ = _run("hermes", _pieces(answer), lambda c: create(c, stream=True))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [(o.type, getattr(o, "name", None)) for o in final.output] == [
        ("message", None), ("function_call", "get_weather")]
    assert final.output[0].content[0].text == "Checking.\n"
    assert final.output[1].arguments == r.output[1].arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_llama3_json_calls_alone():
    answer = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    r, _ = _run("llama3_json", _pieces(answer), lambda c: _stream_chat(c))
    calls = [t for ch in r if ch.choices for t in ch.choices[0].delta.tool_calls or ()]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        ("get_weather", {"city": "Paris"})]
    assert not any(ch.choices and ch.choices[0].delta.content for ch in r)


def test_without_a_parser_auto_is_a_400_naming_the_flags():
    with pytest.raises(openai.BadRequestError) as e:
        _run(None, ["x"], lambda c: _chat(c, max_tokens=10))
    assert "--enable-auto-tool-choice" in e.value.body["message"]
    assert e.value.body["param"] == "tool_choice"
