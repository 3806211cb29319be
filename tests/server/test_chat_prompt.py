"""How a chat request becomes the engine's prompt (``ChatCompletionRequest.prompt_text``):
vLLM's ``add_generation_prompt`` / ``continue_final_message`` and what is refused. The
real template against transformers is in tests/model/test_tokenizer.py; here a stand-in
template trims contents, as many do."""

from __future__ import annotations

import pytest

from kvscope.engine.server.errors import APIError
from kvscope.engine.server.protocol import ChatCompletionRequest
from kvscope.engine.server.strict import parse


class TrimmingTemplate:
    def apply_chat_template(self, conv: list[dict], add_generation_prompt: bool) -> str:
        text = "".join(f"<{m['role']}>{m['content'].strip()}</{m['role']}>\n" for m in conv)
        return text + ("<assistant>" if add_generation_prompt else "")


class DroppingTemplate:  # renders roles only
    def apply_chat_template(self, conv: list[dict], add_generation_prompt: bool) -> str:
        return "".join(f"<{m['role']}>" for m in conv)


def _req(**body: object) -> ChatCompletionRequest:
    import json

    return parse(ChatCompletionRequest, json.dumps(body).encode())


CONV = [{"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "My favourite is  "}]


def test_generation_prompt_by_default_and_off_on_request():
    assert _req(messages=CONV[:1]).prompt_text(TrimmingTemplate()) == \
        "<user>Name a colour.</user>\n<assistant>"
    assert _req(messages=CONV[:1], add_generation_prompt=False).prompt_text(
        TrimmingTemplate()) == "<user>Name a colour.</user>\n"


def test_continue_final_message_cuts_after_the_trimmed_content():
    text = _req(messages=CONV, add_generation_prompt=False,
                continue_final_message=True).prompt_text(TrimmingTemplate())
    assert text == "<user>Name a colour.</user>\n<assistant>My favourite is"


def test_a_template_that_drops_the_content_cannot_be_continued():
    req = _req(messages=CONV, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match="cannot be continued"):
        req.prompt_text(DroppingTemplate())


@pytest.mark.parametrize(("body", "words"), [
    ({"messages": CONV, "continue_final_message": True}, "add_generation_prompt"),
    ({"messages": [*CONV[:1], {"role": "assistant", "content": ""}],
      "add_generation_prompt": False, "continue_final_message": True}, "final message"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
     "'image_url' are not supported"),
])
def test_refused_with_a_clear_message(body, words):
    with pytest.raises(APIError) as e:
        _req(**body)
    assert words in str(e.value.message)


def test_text_parts_and_an_empty_tools_list_are_accepted():
    req = _req(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                      {"type": "text", "text": "b"}]}],
               tools=[], tool_choice="none")
    assert req.conversation() == [{"role": "user", "content": "ab"}]
    # tools without tool_choice: "auto", which the handler refuses unless the server has
    # a tool-call parser (tests/server/test_auto_tools.py)
    assert _req(messages=CONV[:1], tools=[{"type": "function", "function": {"name": "f"}}]
                ).auto_tools


class ToolsTemplate:
    """Shows what a tool-aware template receives."""

    def apply_chat_template(self, conv: list[dict], add_generation_prompt: bool,
                            tools: list | None = None) -> str:
        shown = ",".join(t["function"]["name"] for t in tools or [])
        calls = [c["function"]["arguments"] for m in conv for c in m.get("tool_calls") or []]
        return f"tools[{shown}] calls{calls} " + " | ".join(str(m["content"]) for m in conv)


def test_the_template_sees_tools_only_when_a_call_is_asked_for():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    earlier = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "f", "arguments": '{"x": 1}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "done"}]
    named = {"type": "function", "function": {"name": "f"}}
    text = _req(messages=earlier, tools=[tool], tool_choice=named).prompt_text(ToolsTemplate())
    assert text.startswith("tools[f] calls[{'x': 1}]")  # arguments parsed, as templates expect
    none = _req(messages=earlier, tools=[tool], tool_choice="none").prompt_text(ToolsTemplate())
    assert none.startswith("tools[] ")


def test_required_calls_stream_whole_once_each_closes():
    from kvscope.engine.server.tools import RequiredCallStream

    text = '[{"name": "f", "parameters": {"s": "a}b", "n": [1, {"x": 2}]}}, {"name": "g", ' \
           '"parameters": {}}]'
    stream, seen = RequiredCallStream(), []
    for i, ch in enumerate(text):
        for call in stream.feed(ch):
            seen.append((i, call["index"], call["function"]["name"],
                         call["function"]["arguments"]))
    first_close = text.index("}}") + 1
    assert seen == [(first_close, 0, "f", '{"s": "a}b", "n": [1, {"x": 2}]}'),
                    (len(text) - 2, 1, "g", "{}")]
    cut = RequiredCallStream()
    assert cut.feed('[{"name": "f", "param') == [] and cut.count == 0
    assert cut.text == '[{"name": "f", "param'


def test_chat_template_kwargs_reach_the_template_and_cannot_override_the_request():
    """vLLM's chat_template_kwargs (Qwen3's enable_thinking is the common one)."""
    from kvscope.engine.model.chat_template import render_chat

    class Thinking:
        def apply_chat_template(self, conv: list[dict], add_generation_prompt: bool,
                                **extra: object) -> str:
            return render_chat("{% if enable_thinking is defined and not enable_thinking %}"
                               "/no_think {% endif %}{{ messages[0]['content'] }}", conv,
                               add_generation_prompt, {}, **extra)

    assert _req(messages=CONV[:1]).prompt_text(Thinking()) == "Name a colour."
    off = _req(messages=CONV[:1], chat_template_kwargs={"enable_thinking": False})
    assert off.prompt_text(Thinking()) == "/no_think Name a colour."
    for key in ("add_generation_prompt", "tools", "messages"):
        with pytest.raises(APIError) as e:
            _req(messages=CONV[:1], chat_template_kwargs={key: True})
        assert e.value.param == "chat_template_kwargs"
