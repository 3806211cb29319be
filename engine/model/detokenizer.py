"""Incremental detokenization: text grows token by token without re-decoding the whole output,
and a multi-byte character split across tokens is emitted only once complete."""

from __future__ import annotations

from kvscope.engine.model.tokenizer import Tokenizer

# Context tokens from the prompt: enough for the decoder to treat the first output token as a
# continuation (byte-level BPE needs little; sentencepiece-style decoders need a few).
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Invariant: `text` == decode(output ids) except for a trailing incomplete character,
    which is held back (decode would show it as U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly "")."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset:], self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
