"""Our tokenizer (built from the GGUF metadata, or loaded from tokenizer.json) against
transformers' tokenizer for the same file: ids, decoding and chat templates."""

from __future__ import annotations

import pytest

from kvscope.engine.model.detokenizer import IncrementalDetokenizer
from kvscope.engine.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; π ≈ 3.14159 and 1,000,000 > 999999.",
    "naïve café — Zürich, 東京, Москва, مرحبا, 🤖🚀 emoji",
    "  leading spaces,\ttabs\t\tand\n\n\nnewlines   trailing   ",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment\n",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll say it's 'quoted' and \"double\" -- you've seen it, we'd know.",
    "",
    "x" * 50 + " " * 7 + "0123456789" * 3,
    "\u00a0non-breaking\u2009thin\u200bzero-width",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Count to 3."}, {"role": "assistant", "content": "1, 2, 3."},
     {"role": "user", "content": "Now backwards, with émojis 🎉"}],
    [{"role": "user", "content": "line one\n\n  line two  "}],
]


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    return smollm2[1]


@pytest.mark.parametrize("text", TEXTS)
def test_ids_match_transformers(tokenizer, hf_tokenizer, text):
    assert tokenizer.encode(text) == hf_tokenizer.encode(text)
    assert tokenizer.encode(text, add_special_tokens=False) == \
        hf_tokenizer.encode(text, add_special_tokens=False)


def test_stock_transformers_gguf_digit_divergence(tokenizer, hf_tokenizer_stock):
    """Pins the one known difference from transformers' stock GGUF tokenizer (see conftest):
    spaces before a digit. We follow llama.cpp's "smollm" rule: the digit stands alone and the
    spaces before it form their own token(s); stock transformers glues one space to the digit."""
    text = "x   0"
    ours = tokenizer.convert_ids_to_tokens(tokenizer.encode(text))
    stock = hf_tokenizer_stock.convert_ids_to_tokens(hf_tokenizer_stock.encode(text))
    assert ours[-1] == "0" and "Ġ0" not in ours
    assert stock != ours
    assert tokenizer.encode("Hello world, 42!") == hf_tokenizer_stock.encode("Hello world, 42!")


def test_gpl3_text_ids_match(tokenizer, hf_tokenizer):
    text = open("/usr/share/common-licenses/GPL-3", encoding="utf-8").read()[:12000]
    ids = tokenizer.encode(text)
    assert len(ids) > 2000
    assert ids == hf_tokenizer.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip_matches_transformers(tokenizer, hf_tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer, conversation,
                                            add_generation_prompt):
    ours = tokenizer.apply_chat_template(conversation, add_generation_prompt)
    theirs = hf_tokenizer.apply_chat_template(conversation, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt, tokenize=True)
    assert ids == hf_tokenizer.encode(theirs, add_special_tokens=False)


@pytest.mark.parametrize("final", ["The capital of France is", "Sure, here it is: ",
                                   "1, 2, 3.\n\n", "x"])
def test_continue_final_message_matches_transformers(tokenizer, hf_tokenizer, final):
    """A chat request's assistant prefill (vLLM's ``continue_final_message``) renders as
    transformers' ``apply_chat_template(..., continue_final_message=True)``."""
    from kvscope.engine.server.protocol import ChatCompletionRequest

    conv = [*CONVERSATIONS[2], {"role": "assistant", "content": final}]
    req = ChatCompletionRequest.model_validate(
        {"messages": conv, "add_generation_prompt": False, "continue_final_message": True})
    theirs = hf_tokenizer.apply_chat_template(conv, tokenize=False, continue_final_message=True)
    assert req.prompt_text(tokenizer) == theirs
    assert theirs.endswith(final)  # this template keeps the content as written


def test_default_system_prompt(tokenizer):
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")


def test_bad_chat_message_is_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match="dicts with a 'role'"):
        tokenizer.apply_chat_template(["just a string"])


def test_tokenizer_json_directory(tmp_path, hf_tokenizer):
    """Tokenizer.from_dir on what transformers saves (tokenizer.json + template)."""
    hf_tokenizer.save_pretrained(tmp_path)
    ours = Tokenizer.from_dir(tmp_path)
    assert ours.eos_token_ids == (2,) and ours.bos_token_id == 1
    for text in TEXTS:
        assert ours.encode(text) == hf_tokenizer.encode(text)
    for conversation in CONVERSATIONS:
        assert ours.apply_chat_template(conversation) == hf_tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("text", TEXTS[1:5])
def test_incremental_detokenizer_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt: "))
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == detok.text == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)  # split multi-byte chars are held back
