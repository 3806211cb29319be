"""Tokenizer: a `tokenizers` BPE built from GGUF metadata (byte-level, or SentencePiece in
engine.model.tokenizer_spm) or loaded from tokenizer.json, plus the model's chat template.
Token ids match transformers' tokenizer for the same files."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from kvscope.engine.model.chat_template import render_chat
from kvscope.engine.model.errors import ModelLoadError

# GGUF token types (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


def _gguf_pre_tokenizer(pre: str | None) -> Any:
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # llama.cpp's "smollm" splits every digit apart before GPT-2's regex, as SmolLM's own
        # tokenizer.json does (Digits(individual_digits) then ByteLevel).
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in (None, "default", "gpt2", "gpt-2"):
        return byte_level
    raise ModelLoadError(f"unsupported GGUF pre-tokenizer {pre!r} (supported: smollm, gpt2)")


# Characters from which encoding releases the GIL (Tokenizer.encode): ~1 ms of work.
_LONG_TEXT = 8192


class Tokenizer:
    """Invariant: `eos_token_ids` is non-empty when the model defines an end of sequence;
    encode() adds BOS (EOS) only when the model asks for it (add_bos, add_eos)."""

    def __init__(self, backend: Any, bos_token_id: int | None, eos_token_ids: tuple[int, ...],
                 chat_template: str | None, add_bos: bool = False,
                 add_eos: bool = False) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.add_bos = add_bos
        self.add_eos = add_eos

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], source: str) -> Tokenizer:
        from tokenizers import AddedToken, decoders, models
        from tokenizers import Tokenizer as HFTokenizer

        model = meta.get("model")
        if model == "llama":  # SentencePiece (Llama 2, Mistral 7B, Phi-3, Gemma 3)
            from kvscope.engine.model.tokenizer_spm import spm_backend

            eos = meta.get("eos_token_id")
            # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
            add_bos = meta.get("add_bos_token")
            return cls(spm_backend(meta, source), meta.get("bos_token_id"),
                       () if eos is None else (int(eos),), meta.get("chat_template"),
                       add_bos=True if add_bos is None else bool(add_bos),
                       add_eos=bool(meta.get("add_eos_token")))
        if model != "gpt2":
            raise ModelLoadError(f"{source}: unsupported GGUF tokenizer model {model!r} "
                                 "(supported: gpt2 byte-level BPE, llama SentencePiece)")
        if not meta.get("merges"):
            raise ModelLoadError(f"{source}: GGUF tokenizer has no merges")
        tokens: list[str] = list(meta["tokens"])
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {
            (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
            for i, t in enumerate(tokens)
        }
        merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
        try:
            backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        except Exception as exc:
            raise ModelLoadError(f"{source}: GGUF vocabulary/merges are inconsistent: {exc}") \
                from exc
        try:
            backend.pre_tokenizer = _gguf_pre_tokenizer(meta.get("pre"))
        except ModelLoadError as exc:
            raise ModelLoadError(f"{source}: {exc}") from exc
        backend.decoder = decoders.ByteLevel()
        types = meta.get("token_type") or []
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                    for t, ty in zip(tokens, types, strict=False)
                                    if ty == _CONTROL and set(t) <= alphabet])
        backend.add_tokens([AddedToken(t, special=False, normalized=False)
                            for t, ty in zip(tokens, types, strict=False) if ty == _USER_DEFINED])
        eos = meta.get("eos_token_id")
        return cls(backend, meta.get("bos_token_id"), () if eos is None else (int(eos),),
                   meta.get("chat_template"), add_bos=bool(meta.get("add_bos_token")))

    @classmethod
    def from_dir(cls, model_dir: Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        """Load tokenizer.json (+ tokenizer_config.json / chat_template.jinja if present).
        BOS is added by tokenizer.json's own post-processor, as in transformers."""
        from tokenizers import Tokenizer as HFTokenizer

        path = model_dir / "tokenizer.json"
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelLoadError(f"{path}: cannot load tokenizer ({exc})") from exc
        cfg: dict[str, Any] = {}
        cfg_path = model_dir / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise ModelLoadError(f"{cfg_path}: not readable JSON ({exc})") from exc
        template = cfg.get("chat_template")
        jinja = model_dir / "chat_template.jinja"
        if jinja.is_file():
            template = jinja.read_text(encoding="utf-8")

        def token_id(key: str) -> int | None:
            tok = cfg.get(key)
            if isinstance(tok, dict):
                tok = tok.get("content")
            return None if tok is None else backend.token_to_id(tok)

        eos = token_id("eos_token")
        eos_ids = tuple(dict.fromkeys([*eos_token_ids, *([] if eos is None else [eos])]))
        return cls(backend, token_id("bos_token"), eos_ids, template, add_bos=False)

    # -- text <-> ids -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes one token stands for, at most: the longest vocabulary entry in
        UTF-8 (a byte-level or byte-fallback spelling only overstates it)."""
        vocab = self.backend.get_vocab(with_added_tokens=True)
        return max((len(t.encode("utf-8")) for t in vocab), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. A long text is encoded with the GIL released, so the
        engine thread and the event loop keep running while a server tokenizes a heavy
        prompt (``tokenizers``' ``encode`` holds the GIL throughout: about 90 ms for 131k
        characters; ``encode_batch`` releases it)."""
        if len(text) >= _LONG_TEXT:
            ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:  # the batch path's thread pool is not worth a short text
            ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        if add_special_tokens and self.add_eos and self.eos_token_ids:
            ids = [*ids, self.eos_token_ids[0]]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in ids]

    def token_text(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # -- chat ---------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, tokenize: bool = False,
                            **extra: Any) -> str | list[int]:
        """Render like transformers' apply_chat_template. With tokenize=True the rendered text
        is encoded without adding special tokens (the template already holds them)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass raw prompts instead")

        def text_of(token_id: int | None) -> str | None:
            return None if token_id is None else self.backend.id_to_token(token_id)

        special = {"bos_token": text_of(self.bos_token_id),
                   "eos_token": text_of(self.eos_token_ids[0] if self.eos_token_ids else None)}
        text = render_chat(self.chat_template, messages, add_generation_prompt, special, **extra)
        return self.encode(text, add_special_tokens=False) if tokenize else text
