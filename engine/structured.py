"""Structured outputs: a completion constrained to a JSON schema, any JSON object, a regex,
one of several strings or a Lark grammar (vLLM's ``StructuredOutputsParams``; the server's
``response_format`` and ``structured_outputs``).

The grammar engine is llguidance (the one vLLM, SGLang and llama.cpp use): it compiles the
constraint against the model's tokenizer and, before each sampled token, gives the set of
tokens that keep the output inside it. kvscope only wires it in:

- A constraint compiles once (``StructuredOutputsParams.compile``: the server does it at
  the boundary, off its event loop, and a bad constraint is a 400 there); every completion
  of the request then starts from a copy of that compiled matcher. Compiling includes the
  first mask (llguidance builds its lexer lazily: an expensive or broken constraint shows
  at admission, not inside an engine step), and the last ``COMPILED_CACHE`` grammars are
  kept, failures included: the same constraint is never compiled twice.
- A constraint is untrusted: its grammar is at most ``MAX_GRAMMAR_BYTES``, llguidance runs
  with its resource limits and without verbose errors (they quote the grammar), and every
  failure is a ``ConstraintError`` with a short message (``short_error``).
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

import collections
import json
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


# The largest grammar (llguidance's text, what a schema or regex compiles to) a request may
# bring. Measured with SmolLM2's tokenizer on the dev box: a schema of 500 optional
# properties is 12.6 KB and compiles in 0.6 s; 2,000 (52 KB) take 6.6 s, 5,000 (129 KB)
# 38 s. 32 KiB admits every realistic schema and keeps a compile in the seconds.
MAX_GRAMMAR_BYTES = 32 << 10
# The longest a constraint may take to compile (with its first mask). The server stops
# waiting then (a 400); the compile itself runs on (llguidance cannot be interrupted) and
# is remembered as this error, so the same constraint is refused at once, consistently.
MAX_COMPILE_S = 5.0
COMPILED_CACHE = 64  # compiled grammars (or their errors) kept, per process
ERROR_CHARS = 200  # what a ConstraintError keeps of llguidance's message


class ConstraintError(ValueError):
    """A structured-output constraint that cannot be used: it does not compile, exceeds a
    limit, or (during generation) leaves no token. The message is short and never quotes
    the grammar."""


def too_slow() -> str:
    return (f"structured outputs: the constraint did not compile within {MAX_COMPILE_S:g} s;"
            " simplify it")


def short_error(text: str) -> str:
    """llguidance's message cut to its first line and ERROR_CHARS characters."""
    line = str(text).strip().splitlines()[0] if str(text).strip() else "invalid constraint"
    return line if len(line) <= ERROR_CHARS else line[:ERROR_CHARS] + "..."


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
            except (ValueError, RecursionError) as e:
                raise ConstraintError(f"structured outputs: {short_error(e)}") from None
        try:
            if self.regex is not None:
                return LLMatcher.grammar_from_regex(self.regex)
            if self.choice is not None:
                return LLMatcher.grammar_from_regex("|".join(_regex_literal(c)
                                                             for c in self.choice))
            return LLMatcher.grammar_from_lark(self.grammar or "")
        except ValueError as e:
            raise ConstraintError(f"structured outputs: {short_error(e)}") from None

    def compile(self, tokenizer: Any) -> Any:
        """The constraint compiled against ``tokenizer`` (kvscope's Tokenizer), as an
        llguidance matcher in its start state: built on the first call, the same object
        after (a copy per completion is ``GrammarMatcher``'s). Raises ConstraintError
        (a ValueError) with a short message when the constraint cannot be used."""
        if tokenizer is None:
            raise ConstraintError("structured outputs need the model's tokenizer (a dummy "
                                  "model has none)")
        if self._compiled is not None and self._compiled[0] is tokenizer:
            return self._compiled[1]
        text = self.grammar_text()
        if len(text) > MAX_GRAMMAR_BYTES:
            raise ConstraintError(f"structured outputs: the constraint's grammar is "
                                  f"{len(text)} bytes, over the limit of {MAX_GRAMMAR_BYTES}")
        matcher = _COMPILED.get(_ll_tokenizer(tokenizer), text)
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


class _CompiledGrammars:
    """The last COMPILED_CACHE grammars compiled, by (llguidance tokenizer, grammar text):
    the start-state matcher, or the ConstraintError it gave. Thread-safe; a grammar being
    compiled on one thread is waited for, not compiled again, on another."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: collections.OrderedDict[tuple[Any, str], Any] = collections.OrderedDict()
        self._busy: dict[tuple[Any, str], threading.Event] = {}
        self.compiles = 0  # grammars compiled (the rest were found here)
        self.last_compile_s = 0.0

    def get(self, ll: Any, text: str) -> Any:
        key = (ll, text)  # the tokenizer by identity (it lives as long as its model)
        while True:
            with self._lock:
                if key in self._done:
                    self._done.move_to_end(key)
                    found = self._done[key]
                    break
                busy = self._busy.get(key)
                if busy is None:
                    self._busy[key] = threading.Event()
                    found = None
                    break
            busy.wait()
        if found is None:
            try:
                found = self._compile(ll, text)
            finally:
                with self._lock:
                    if found is not None:
                        self._done[key] = found
                        if len(self._done) > COMPILED_CACHE:
                            self._done.popitem(last=False)
                    self._busy.pop(key).set()
        if isinstance(found, ConstraintError):
            raise ConstraintError(str(found))
        return found

    def _compile(self, ll: Any, text: str) -> Any:
        from llguidance import LLMatcher, LLParserLimits

        t0 = time.perf_counter()
        try:
            matcher = LLMatcher(ll, text, log_level=0,
                                limits=LLParserLimits(verbose_errors=False))
            if not matcher.is_error():
                matcher.compute_bitmask()  # builds the lexer now (see the module docstring)
        except (ValueError, RuntimeError) as e:  # llguidance's own refusals
            return ConstraintError(f"structured outputs: {short_error(e)}")
        finally:
            self.compiles += 1
            self.last_compile_s = took = time.perf_counter() - t0
        if took > MAX_COMPILE_S:
            return ConstraintError(too_slow())
        if matcher.is_error():
            return ConstraintError(f"structured outputs: {short_error(matcher.get_error())}")
        return matcher


_COMPILED = _CompiledGrammars()


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
            raise ConstraintError(f"structured outputs: {short_error(self._m.get_error())}")

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
            raise ConstraintError("structured outputs: the grammar allows no next token")
        out = np.zeros(vocab_size, dtype=bool)
        n = min(vocab_size, mask.shape[0])
        out[:n] = mask[:n]
        return torch.from_numpy(out)

    def accept(self, token: int) -> None:
        """Consume the sampled token. A token outside the last mask is a ValueError (the
        request fails alone)."""
        if not self._m.consume_token(token):
            raise ConstraintError(f"structured outputs: token {token} is outside the "
                                  f"grammar: {short_error(self._m.get_error())}")
