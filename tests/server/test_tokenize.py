"""vLLM's /tokenize and /detokenize: the ids are the model's own (the same the engine
prefills: a chat form's count equals the chat completion's usage.prompt_tokens), detokenize
inverts them, and bad input is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import Daemon

HI = [{"role": "user", "content": "What is the capital of France?"}]


def _post(d: Daemon, path: str, body: dict) -> httpx.Response:
    return httpx.post(d.url + path, json=body, timeout=60)


def test_tokenize_text_and_detokenize_round_trip(daemon: Daemon):
    text = "The year 2024 had 366 days."
    r = _post(daemon, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["count"] == len(got["tokens"]) == len(got["token_strs"]) > 5
    assert got["max_model_len"] > 0 and "".join(got["token_strs"]).replace("Ġ", " ") == text
    completion = _post(daemon, "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert completion.json()["usage"]["prompt_tokens"] == got["count"]
    back = _post(daemon, "/detokenize", {"tokens": got["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    assert _post(daemon, "/tokenize", {"prompt": text}).json()["token_strs"] is None


def test_tokenize_chat_counts_what_a_chat_completion_prefills(daemon: Daemon):
    r = _post(daemon, "/tokenize", {"messages": HI})
    chat = _post(daemon, "/v1/chat/completions", {"messages": HI, "max_tokens": 1})
    assert r.status_code == chat.status_code == 200, r.text
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    text = _post(daemon, "/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    no_turn = _post(daemon, "/tokenize", {"messages": HI, "add_generation_prompt": False})
    assert no_turn.json()["count"] < r.json()["count"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": "x", "add_special_token": True}, "add_special_token"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ("/tokenize", {"messages": HI, "continue_final_message": True}, "continue_final_message"),
    ("/detokenize", {"tokens": [1, 2, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
])
def test_bad_tokenize_requests_are_refused_by_field(daemon: Daemon, path, body, param):
    r = _post(daemon, path, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param
    assert _post(daemon, "/tokenize", {"prompt": "still serving"}).status_code == 200


def test_a_chat_template_given_on_the_command_line_replaces_the_models(tmp_path):
    """vLLM's --chat-template: a file (or the template itself) renders every chat prompt;
    here one that also shows the tools, which SmolLM2's own template does not."""
    from tests.server.conftest import SHARED, start_daemon, stop_daemon

    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                   "{% if tools %}[tools: {{ tools | map(attribute='function') "
                   "| map(attribute='name') | join(',') }}]\n{% endif %}"
                   "{% if add_generation_prompt %}<assistant>{% endif %}")
    d = start_daemon(*SHARED, "--chat-template", str(tpl))
    try:
        r = _post(d, "/tokenize", {"messages": HI, "return_token_strs": True})
        text = "".join(r.json()["token_strs"]).replace("Ġ", " ").replace("Ċ", "\n")
        assert text == "<user>What is the capital of France?\n<assistant>"
        chat = _post(d, "/v1/chat/completions", {"messages": HI, "max_tokens": 1,
                                                 "tools": [{"type": "function", "function": {
                                                     "name": "geo"}}],
                                                 "tool_choice": "required"})
        assert chat.status_code == 200, chat.text
        shown = _post(d, "/tokenize", {"messages": HI, "return_token_strs": True})
        assert shown.json()["count"] == r.json()["count"]  # /tokenize takes no tools
        assert chat.json()["usage"]["prompt_tokens"] > r.json()["count"]  # the tools shown
    finally:
        stop_daemon(d)
