"""vLLM's /tokenize and /detokenize: the ids are the model's own (the same the engine
prefills: a chat form's count equals the chat completion's usage.prompt_tokens), detokenize
inverts them, and bad input is a 400 naming the field."""

from __future__ import annotations

import httpx
import pytest

from tests.server.asgi import InProcess

HI = [{"role": "user", "content": "What is the capital of France?"}]


def _post(served: InProcess, path: str, body: dict) -> httpx.Response:
    return served.http.post(path, json=body)


def test_tokenize_text_and_detokenize_round_trip(served: InProcess):
    text = "The year 2024 had 366 days."
    r = _post(served, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["count"] == len(got["tokens"]) == len(got["token_strs"]) > 5
    assert got["max_model_len"] > 0 and "".join(got["token_strs"]).replace("Ġ", " ") == text
    completion = _post(served, "/v1/completions", {"prompt": text, "max_tokens": 1})
    assert completion.json()["usage"]["prompt_tokens"] == got["count"]
    back = _post(served, "/detokenize", {"tokens": got["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    assert _post(served, "/tokenize", {"prompt": text}).json()["token_strs"] is None


def test_tokenize_chat_counts_what_a_chat_completion_prefills(served: InProcess):
    r = _post(served, "/tokenize", {"messages": HI})
    chat = _post(served, "/v1/chat/completions", {"messages": HI, "max_tokens": 1})
    assert r.status_code == chat.status_code == 200, r.text
    assert r.json()["count"] == chat.json()["usage"]["prompt_tokens"]
    text = _post(served, "/detokenize", {"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")
    no_turn = _post(served, "/tokenize", {"messages": HI, "add_generation_prompt": False})
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
def test_bad_tokenize_requests_are_refused_by_field(served: InProcess, path, body, param):
    r = _post(served, path, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param
    assert _post(served, "/tokenize", {"prompt": "still serving"}).status_code == 200


def test_a_chat_template_given_on_the_command_line_replaces_the_models(tmp_path):
    """vLLM's --chat-template: a file (or the template itself) renders every chat prompt;
    here one that also shows the tools, which SmolLM2's own template does not."""
    from tests.server.conftest import SHARED, serve_in_process

    tpl = tmp_path / "t.jinja"
    tpl.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                   "{% if tools %}[tools: {{ tools | map(attribute='function') "
                   "| map(attribute='name') | join(',') }}]\n{% endif %}"
                   "{% if add_generation_prompt %}<assistant>{% endif %}")
    d = serve_in_process(*SHARED, "--chat-template", str(tpl))
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
        d.close()
