"""tool_choice "auto"'s parsers (vLLM's hermes and llama3_json formats): calls are read
out of answers in the model family's syntax, an answer whose calls do not parse stays
content, and a streamed answer, cut anywhere, is exactly the unstreamed one."""

from __future__ import annotations

import json

import pytest

from kvscope.engine.server.tool_parsers import PARSERS, AutoToolStream

HERMES = PARSERS["hermes"]
LLAMA = PARSERS["llama3_json"]


def _args(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


@pytest.mark.parametrize(("text", "content", "calls"), [
    ('<tool_call>\n{"name": "w", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("w", {"city": "Paris"})]),
    ('Let me check.\n<tool_call>\n{"name": "w", "arguments": {"city": "Paris"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "Let me check.\n", [("w", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]),
    # cut short after a complete object (max_tokens inside the closing tag)
    ('<tool_call>\n{"name": "w", "arguments": {}}\n</tool', None, []),
    ('<tool_call>\n{"name": "w", "arguments": {}}\n', None, [("w", {})]),
    ('<tool_call>{"name": "w", "arguments": "{\\"c\\": 1}"}</tool_call>', None,
     [("w", {"c": 1})]),  # arguments written as JSON text
    ("Paris is sunny.", "Paris is sunny.", []),
    ('<tool_call>{"name": "w", "arguments": {"c": </tool_call>', None, []),  # malformed
    ("Use <tool_call> tags.", "Use <tool_call> tags.", []),
])
def test_hermes(text: str, content: str | None, calls: list) -> None:
    got_content, got_calls = HERMES.parse(text)
    assert _args(got_calls) == calls
    assert got_content == (content if calls else text)


@pytest.mark.parametrize(("text", "calls"), [
    ('{"name": "w", "parameters": {"city": "Paris"}}', [("w", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "w", "parameters": {"city": "Paris"}}',
     [("w", {"city": "Paris"})]),
    (' {"name": "w", "parameters": {}}; {"name": "add", "arguments": {"a": 1}}',
     [("w", {}), ("add", {"a": 1})]),
    ("The weather is fine.", []),
    ('{"name": "w", "parameters": {}} and then some', []),
    ('{"city": "Paris"}', []),  # JSON, but not a call
    ('{"name": "w", "parameters": ', []),  # cut short
])
def test_llama3_json(text: str, calls: list) -> None:
    content, got = LLAMA.parse(text)
    assert _args(got) == calls
    assert content == (None if calls else text)


STREAMED = [
    (HERMES, 'Sure.\n<tool_call>\n{"name": "w", "arguments": {"city": "Paris"}}\n</tool_call>'),
    (HERMES, '\n<tool_call>{"name": "w", "arguments": {}}</tool_call>'),
    (HERMES, "No tools needed: <tool_c is not a tag, <tool_call> is one."),
    (HERMES, "Plain text < with a bracket."),
    (HERMES, ""),
    (LLAMA, '{"name": "w", "parameters": {"city": "Paris"}}'),
    (LLAMA, "  The answer is 4."),
    (LLAMA, '{"not": "a call"}'),
]


@pytest.mark.parametrize(("parser", "text"), STREAMED)
def test_a_streamed_answer_equals_the_unstreamed_one_wherever_it_is_cut(parser, text):
    content, calls = parser.parse(text)
    expected = ((content or "") if calls else text), _args(calls)
    cuts = [[text[:i], text[i:j], text[j:]] for i in range(len(text) + 1)
            for j in range(i, len(text) + 1, max(1, len(text) // 7))]
    cuts.append(list(text))  # a character at a time
    for pieces in cuts:
        s = AutoToolStream(parser)
        sent = "".join(s.feed(p) for p in pieces)
        rest, got = s.finish()
        assert (sent + rest, _args(got)) == expected, pieces


def test_content_before_a_call_streams_before_the_answer_ends():
    s = AutoToolStream(HERMES)
    assert s.feed("Let me look that up. ") == "Let me look that up. "
    assert s.feed("<tool") == ""  # may be a tag: held
    assert s.feed('_call>{"name": "w", "arguments": {}}</tool_call>') == ""
    assert s.finish() == ("", [{"name": "w", "arguments": "{}"}])
