"""The Responses API's pure halves, without a daemon: the translation of input items onto a
chat conversation, and the event stream of answers the live tests cannot provoke on
purpose (a tool call cut short, an engine error mid-stream). Each stream is checked with the
openai SDK's own accumulator, which raises on events out of order or items that change
identity."""

from __future__ import annotations

import json

from openai import omit
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from kvscope.engine.server.errors import APIError
from kvscope.engine.server.responses_format import ResponseEvents, ResponseShape, output_items
from kvscope.engine.server.responses_protocol import ResponsesRequest
from kvscope.engine.server.strict import parse

USAGE = {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 2,
         "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 5}


def _request(**body) -> ResponsesRequest:
    return parse(ResponsesRequest, json.dumps({"input": "hi", **body}).encode())


def _run(made, pieces: list[str], finish: str | None = "stop") -> tuple[list[dict], object]:
    """Feed ``pieces`` through ResponseEvents; the raw events and the SDK's final snapshot."""
    events = ResponseEvents(ResponseShape(_request().echo(), "m"), made)
    sse = events.start()
    for p in pieces:
        sse += events.feed(p)
    sse += events.finish(finish, USAGE)
    raw = [json.loads(s.split("data: ", 1)[1]) for s in sse]
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for ev in raw:
        # as the SDK reads a stream: construct_type, then its accumulator
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=ev))
    return raw, state


def test_function_calls_and_their_outputs_become_chat_messages():
    req = _request(instructions="Be kind.", input=[
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "function_call", "call_id": "c1", "name": "w", "arguments": '{"c": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": '{"c": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "rain"}]}])
    msgs = req.messages()
    assert msgs[0] == {"role": "system", "content": "Be kind."}
    assert msgs[2]["role"] == "assistant" and msgs[2]["content"] is None
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["c1", "c2"]  # one turn, two calls
    assert msgs[3:] == [{"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                        {"role": "tool", "tool_call_id": "c2", "content": "rain"}]
    chat = req.chat_request()  # a valid chat request
    assert chat.conversation()[2]["tool_calls"][0]["function"]["arguments"] == {"c": "Paris"}


def test_a_text_stream_ends_as_the_unstreamed_output():
    raw, state = _run(None, ["Hel", "lo", ""])
    final = raw[-1]["response"]
    assert raw[-1]["type"] == "response.completed" and final["status"] == "completed"
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["output"][0]["status"] == "completed"
    assert [e["sequence_number"] for e in raw] == list(range(len(raw)))
    assert state._completed_response.output_text == "Hello"
    unstreamed = output_items("Hello", None, "completed")
    assert [{**i, "id": None} for i in final["output"]] == [{**i, "id": None}
                                                            for i in unstreamed]


def test_required_calls_go_out_whole_and_a_cut_short_answer_stays_text():
    raw, _ = _run("required", ['[{"name": "f", "par', 'ameters": {"x": 1}}, ',
                               '{"name": "g", "parameters": {}}]'])
    calls = raw[-1]["response"]["output"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("f", {"x": 1}),
                                                                        ("g", {})]
    assert len({c["call_id"] for c in calls}) == 2
    raw, _ = _run("required", ['[{"name": "f", "par'], finish="length")
    assert raw[-1]["type"] == "response.incomplete"
    [item] = raw[-1]["response"]["output"]
    assert item["type"] == "message" and item["status"] == "incomplete"
    assert item["content"][0]["text"] == '[{"name": "f", "par'
    # unstreamed, the same cut-short answer is the same message
    assert output_items('[{"name": "f", "par', "required", "incomplete")[0]["type"] == "message"


def test_a_named_call_cut_short_is_an_incomplete_call():
    raw, state = _run({"name": "f"}, ['{"x"', ": 1"], finish="length")
    [item] = raw[-1]["response"]["output"]
    assert item["type"] == "function_call" and item["status"] == "incomplete"
    assert item["arguments"] == '{"x": 1'
    raw, _ = _run({"name": "f"}, ['{"x"', ": 1}"])
    assert raw[-1]["response"]["output"][0]["status"] == "completed"


def test_an_engine_error_mid_stream_fails_the_response():
    events = ResponseEvents(ResponseShape(_request().echo(), "m"), None)
    sse = events.start() + events.feed("partial")
    sse += events.fail(APIError(500, "request aborted (error)", type="server_error"))
    last = json.loads(sse[-1].split("data: ", 1)[1])
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert last["response"]["error"] == {"code": "server_error",
                                         "message": "request aborted (error)"}
