"""A SentencePiece vocabulary from GGUF metadata (``tokenizer.ggml.model == "llama"``: Llama 2,
Mistral 7B, Phi-3, Gemma 3) as a ``tokenizers`` BPE with byte fallback.

llama.cpp tokenizes such a vocabulary (llm_tokenizer_spm) by starting from the text's
characters, spaces written as U+2581 ("▁"), and merging again and again the adjacent pair
whose concatenation is the vocabulary's highest-scoring token (leftmost first); a character
left that is no token is spelled by its UTF-8 bytes' ``<0xAB>`` tokens. A BPE whose merges
are every (left, right) split of each token into two tokens, ranked by that token's score,
merges the same pairs in the same order, so ``tokenizers`` runs it in native code.

Spaces: with ``add_space_prefix`` (the default) each run of text gets one "▁" in front, also
right after a special token, as llama.cpp and SentencePiece's dummy prefix do, and decoding
strips one leading space. Gemma writes its multi-space tokens with real spaces and ranks its
merges by their order in the file (its scores do not follow the merge order), as
transformers reads Gemma GGUFs.
"""

from __future__ import annotations

from typing import Any

from kvscope.engine.model.errors import ModelLoadError

SPACE = "\u2581"
# GGUF token types (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# architectures whose merge order is the file's token order rather than the scores
_RANK_BY_POSITION = ("gemma", "gemma2", "gemma3")


def spm_merges(tokens: list[str], ranks: list[float], mergeable: list[bool]
               ) -> list[tuple[str, str]]:
    """Every split of a mergeable token into two tokens of the vocabulary, best rank (highest
    first) first; splits of one token keep their left piece's length order."""
    vocab = set(tokens)
    scored: list[tuple[float, int, str, str]] = []
    for token, rank, ok in zip(tokens, ranks, mergeable, strict=True):
        if not ok or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                scored.append((-rank, cut, left, right))
    scored.sort(key=lambda s: (s[0], s[1]))
    return [(left, right) for _, _, left, right in scored]


def spm_backend(meta: dict[str, Any], source: str) -> Any:
    """A ``tokenizers.Tokenizer`` for the GGUF SentencePiece vocabulary in ``meta`` (the
    shortened keys of engine.model.gguf_loader.gguf_tokenizer_metadata)."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    tokens: list[str] = list(meta["tokens"])
    types: list[int] = [int(t) for t in (meta.get("token_type") or [NORMAL] * len(tokens))]
    scores = meta.get("scores")
    if len(types) != len(tokens):
        raise ModelLoadError(f"{source}: GGUF tokenizer has {len(tokens)} tokens but "
                             f"{len(types)} token types")
    gemma = meta.get("architecture") in _RANK_BY_POSITION
    if gemma:  # "  " is "▁▁" to the BPE; position is the merge order
        tokens = [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]
        ranks = [-float(i) for i in range(len(tokens))]
    elif scores is None or len(scores) != len(tokens):
        raise ModelLoadError(f"{source}: GGUF SentencePiece tokenizer needs one score per "
                             f"token (tokenizer.ggml.scores)")
    else:
        ranks = [float(s) for s in scores]
    mergeable = [ty in (NORMAL, USER_DEFINED) for ty in types]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = meta.get("unk_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) \
        else None
    try:
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=spm_merges(tokens, ranks,
                                                                         mergeable),
                                         unk_token=unk, fuse_unk=True, byte_fallback=True))
    except Exception as exc:
        raise ModelLoadError(f"{source}: GGUF SentencePiece vocabulary is inconsistent: "
                             f"{exc}") from exc
    prefix = bool(meta.get("add_space_prefix", True))
    spaces = normalizers.Replace(" ", SPACE)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) \
        if prefix else spaces
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types, strict=True) if ty == CONTROL])
    # llama.cpp matches user-defined tokens whole in the raw text (Gemma's "<start_of_image>",
    # Phi-3's chat markers); whitespace ones were respelled above and stay BPE pieces
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types, strict=True)
                        if ty == USER_DEFINED and t.strip(SPACE)])
    return backend
