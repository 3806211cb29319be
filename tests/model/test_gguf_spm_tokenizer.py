"""GGUF SentencePiece tokenizers (``tokenizer.ggml.model == "llama"``: Llama 2, Mistral 7B,
Phi-3, Gemma 3) against two references that share no code with ours: llama.cpp's
llm_tokenizer_spm written out below in plain Python (greedy merging by score, byte
fallback, a space in front of each run of text), and transformers' own GGUF tokenizer loader
(Gemma's and Phi-3's builders) reading the same file."""

from __future__ import annotations

import re

import pytest

from kvscope.engine.model.errors import ModelLoadError
from kvscope.engine.model.gguf_loader import gguf_tokenizer_metadata, open_gguf
from kvscope.engine.model.tokenizer import Tokenizer
from tests.model.tiny_models import write_spm_tokenizer

TEXTS = [
    "the quick brown fox",
    "whether theworld is lazy",  # merges that compete: only the score order gives these ids
    "hello world, hello there",
    " leading space",
    "  two leading, trailing  ",
    "numbers 1234 5678 and 90, 3.14159",
    "café naïve déjà vu",
    "unseen: 東京 🤖 Ωmega zq",  # characters not in the vocabulary: byte fallback
    "tabs\tand\nnew\n\nlines",
    "<|user|>hi there<|end|>",
    "a<|end|> <|user|>b",
    "",
]


def llamacpp_spm(text: str, vocab: dict, add_space_prefix: bool = True) -> list[int]:
    """llama.cpp's SentencePiece tokenization, plainly: control tokens are cut out of the
    text; each run of text between them gets a leading space, spaces become U+2581, and its
    characters are merged again and again at the adjacent pair whose concatenation is the
    highest-scoring token (the leftmost on a tie); what is left that is no token is spelled
    by its UTF-8 bytes' <0xAB> tokens."""
    tokens, scores, types = vocab["tokens"], vocab["scores"], vocab["types"]
    ids = {t: i for i, t in enumerate(tokens)}
    controls = sorted((t for t, ty in zip(tokens, types, strict=True) if ty == 3), key=len,
                      reverse=True)
    out: list[int] = []
    for part in re.split("(" + "|".join(map(re.escape, controls)) + ")", text):
        if not part:
            continue
        if part in controls:
            out.append(ids[part])
            continue
        symbols = list(((" " if add_space_prefix else "") + part).replace(" ", "\u2581"))
        while True:
            best = None
            for i in range(len(symbols) - 1):
                joined = symbols[i] + symbols[i + 1]
                if joined in ids and types[ids[joined]] == 1 and \
                        (best is None or scores[ids[joined]] > best[0]):
                    best = (scores[ids[joined]], i)
            if best is None:
                break
            i = best[1]
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        for s in symbols:
            if s in ids:
                out.append(ids[s])
            else:
                out.extend(ids[f"<0x{b:02X}>"] for b in s.encode("utf-8"))
    return out


def write_tokenizer_gguf(path, arch: str) -> dict:
    """A GGUF holding only a SentencePiece tokenizer (no tensors)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    vocab = write_spm_tokenizer(writer, arch)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return vocab


def ours(path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(gguf_tokenizer_metadata(open_gguf(path), path),
                                        str(path))


def transformers_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "phi3-tokenizer.gguf"
    vocab = write_tokenizer_gguf(path, "phi3")
    return path, vocab, ours(path)


def test_spm_ids_match_llamacpp_and_transformers(phi3):
    path, vocab, tok = phi3
    hf = transformers_tokenizer(path)
    fallback = False
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == llamacpp_spm(text, vocab), text
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert tok.encode(text) == [1, *ids]  # BOS, as add_bos_token asks
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == \
            hf.decode(ids, skip_special_tokens=False), text
        fallback |= any(3 <= i - 2 < 259 for i in ids)  # a <0xAB> token (ids 5..260)
        if "<|" not in text:
            assert tok.decode(ids) == text  # the dummy prefix is stripped again
    assert fallback
    reversed_scores = dict(vocab, scores=[-s for s in vocab["scores"]])
    assert llamacpp_spm(TEXTS[1], vocab) != llamacpp_spm(TEXTS[1], reversed_scores)
    assert tok.convert_ids_to_tokens(tok.encode("hello", add_special_tokens=False)) == \
        ["\u2581hello"]


def test_gemma_spm_matches_transformers(tmp_path):
    """Gemma's layout: no dummy prefix, merges in file order, a multi-space token spelled
    with real spaces, turn markers as control tokens."""
    path = tmp_path / "gemma3-tokenizer.gguf"
    write_tokenizer_gguf(path, "gemma3")
    tok, hf = ours(path), transformers_tokenizer(path)
    assert tok.bos_token_id == 2 and tok.eos_token_ids == (1,) and tok.add_bos
    for text in [*TEXTS, "<start_of_turn>user\nhi  there<end_of_turn>\n"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert tok.encode(text) == [2, *ids]
        assert tok.decode(ids, skip_special_tokens=False) == \
            hf.decode(ids, skip_special_tokens=False), text
        if "<" not in text:
            assert tok.decode(ids) == text
    assert tok.encode(" two", add_special_tokens=False)[0] == \
        tok.backend.token_to_id("\u2581two")  # no dummy prefix: the space is the text's


@pytest.mark.parametrize("model", ["bert", "rwkv", "t5"])
def test_unsupported_gguf_tokenizer_is_refused_by_name(model):
    with pytest.raises(ModelLoadError, match=f"x.gguf: unsupported GGUF tokenizer model "
                                             f"'{model}'"):
        Tokenizer.from_gguf_metadata({"model": model, "tokens": ["a"]}, "x.gguf")


def test_spm_without_scores_is_refused():
    with pytest.raises(ModelLoadError, match="one score per token"):
        Tokenizer.from_gguf_metadata({"model": "llama", "tokens": ["a", "b"],
                                      "token_type": [1, 1]}, "x.gguf")
