"""Structured outputs: a completion constrained to a JSON schema, any JSON object, a regex,
one of several strings or a Lark grammar (vLLM's ``StructuredOutputsParams``; the server's
``response_format`` and ``structured_outputs``).

The grammar engine is llguidance (the one vLLM, SGLang and llama.cpp use): it compiles the
constraint against the model's tokenizer and, before each sampled token, gives the set of
tokens that keep the output inside it. kvscope only wires it in:

- A constraint compiles once (``StructuredOutputsParams.compile``: the server does it at
  the boundary, off its event loop, and a bad constraint is a 400 there); every completion
  of the request then starts from a copy of that compiled matcher.
- ``GrammarMatcher`` is one completion's matcher. Invariant: it has consumed exactly the
  completion's tokens so far, so its mask is the next token's; a recompute or swap
  preemption keeps the tokens, so it stays valid, with nothing to roll back.
- The sampler removes every token outside the mask before it samples (``sample``'s
  ``allowed``); the logprobs a completion reports stay the raw model's (vLLM's default).
- The completion ends ("stop") as soon as the grammar is complete: after that only EOS
  could follow.

llguidance is imported on first use: an engine that never gets a constrained request
never loads it. (torch too: the request models import this module, and the router uses
them without torch.)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint (vLLM's names): ``json`` (a JSON schema, as a dict or its
    text; an object that lists its properties admits no others unless it says so:
    ``closed_objects``), ``json_object`` (any JSON object), ``regex``, ``choice`` (one of
    these strings) or ``grammar`` (Lark syntax, llguidance's dialect)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # (tokenizer, matcher in its start state) once compiled: never advanced, only copied
    _compiled: tuple[Any, Any] | None = field(default=None, init=False, repr=False,
                                             compare=False)

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar")
                 if getattr(self, name) is not None] + (["json_object"] if self.json_object
                                                        else [])
        if len(given) != 1:
            raise ValueError("structured outputs need exactly one of json, json_object, regex, "
                             f"choice, grammar; got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured outputs: 'choice' must be a non-empty list of "
                             "non-empty strings")

    def grammar_text(self) -> str:
        """The constraint as an llguidance grammar (not yet checked: ``compile`` does)."""
        from llguidance import LLMatcher

        if self.json is not None or self.json_object:
            schema = {"type": "object"} if self.json_object else self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise ValueError(f"structured outputs: the JSON schema is not JSON: {e}") \
                        from None
            if not isinstance(schema, dict):
                raise ValueError("structured outputs: a JSON schema must be an object")
            try:
                return LLMatcher.grammar_from_json_schema(closed_objects(schema),
                                                          defaults=JSON_LAYOUT)
            except ValueError as e:
                raise ValueError(f"structured outputs: {e}") from None
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_regex("|".join(_regex_literal(c)
                                                         for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar or "")

    def compile(self, tokenizer: Any) -> Any:
        """The constraint compiled against ``tokenizer`` (kvscope's Tokenizer), as an
        llguidance matcher in its start state: built on the first call, the same object
        after (a copy per completion is ``GrammarMatcher``'s). Raises ValueError with
        llguidance's message when the constraint is invalid."""
        if tokenizer is None:
            raise ValueError("structured outputs need the model's tokenizer (a dummy model "
                             "has none)")
        if self._compiled is not None and self._compiled[0] is tokenizer:
            return self._compiled[1]
        from llguidance import LLMatcher

        matcher = LLMatcher(_ll_tokenizer(tokenizer), self.grammar_text(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured outputs: {matcher.get_error()}")
        object.__setattr__(self, "_compiled", (tokenizer, matcher))  # frozen: a cache only
        return matcher


# JSON comes out compact, `{"a": 1, "b": [2, 3]}` (xgrammar's layout without any_whitespace),
# not with free whitespace: held to a grammar that allows any whitespace between tokens,
# SmolLM2 at temperature 1 filled max_tokens with blank lines in half of its answers (4/8
# complete within 80 tokens, 8/8 compact: scripts/bench_structured.py, docs/BENCHMARKS.md).
# A schema's own "x-guidance" options still override this.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists
    ``properties`` and says nothing about others: what vLLM's default backend (xgrammar's
    strict mode) and OpenAI's strict schemas do. Pydantic's schemas leave it out, and a
    model held to a schema that allows any extra key tends to keep adding keys."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) if k not in ("const", "enum", "default", "examples") else v
           for k, v in schema.items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching only itself."""
    return "".join(f"\\{c}" if c in r"\.^$|?*+()[]{}/" else c for c in text)


def _ll_tokenizer(tokenizer: Any) -> Any:
    """llguidance's view of the tokenizer, built once per Tokenizer (~0.2 s)."""
    ll = getattr(tokenizer, "_llguidance", None)
    if ll is None:
        from llguidance import LLTokenizer

        ll = LLTokenizer(tokenizer.backend.to_str(), eos_token=list(tokenizer.eos_token_ids))
        tokenizer._llguidance = ll
    return ll


class GrammarMatcher:
    """One completion's position in its grammar (see the module's invariant)."""

    def __init__(self, params: StructuredOutputsParams, tokenizer: Any) -> None:
        self._m = params.compile(tokenizer).deep_copy()

    def _error(self) -> None:
        if self._m.is_error():
            raise ValueError(f"structured outputs: {self._m.get_error()}")

    @property
    def stopped(self) -> bool:
        """The grammar is complete: no token but EOS may follow."""
        return self._m.is_stopped()

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """Bool [vocab_size]: the tokens the next sample may take (ids past the tokenizer's
        vocabulary, a model's padding rows, never)."""
        import torch
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little").astype(bool)
        self._error()
        if not mask.any():  # sampling from nothing would pick garbage: fail this one alone
            raise ValueError("structured outputs: the grammar allows no next token")
        out = np.zeros(vocab_size, dtype=bool)
        n = min(vocab_size, mask.shape[0])
        out[:n] = mask[:n]
        return torch.from_numpy(out)

    def accept(self, token: int) -> None:
        """Consume the sampled token. A token outside the last mask is a ValueError (the
        request fails alone)."""
        if not self._m.consume_token(token):
            raise ValueError(f"structured outputs: token {token} is outside the grammar: "
                             f"{self._m.get_error()}")
