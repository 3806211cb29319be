"""Argument checks shared by the cache manager's methods; each raises CacheError."""

from __future__ import annotations

from typing import Any

from kvscope.engine.cache.errors import CacheError


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_count(n: Any) -> None:
    if not is_int(n) or n < 0:
        raise CacheError(f"token counts are ints >= 0, got {n!r}")


def check_new_id(known: Any, seq_id: Any) -> None:
    """A new sequence id: a str that ``known`` (the sequence table) does not hold."""
    if not isinstance(seq_id, str):
        raise CacheError(f"sequence ids are str, got {seq_id!r}")
    if seq_id in known:
        raise CacheError(f"duplicate sequence id {seq_id!r}")


def check_watermark(w: Any) -> None:
    if not (isinstance(w, (int, float)) and 0.0 <= w < 1.0):
        raise CacheError(f"watermark must be in [0, 1), got {w!r}")


def token_list(ids: Any, copy: bool) -> list[int]:
    """Validate token ids (non-negative ints) and return them as a list (a new one if
    ``copy``)."""
    if type(ids) is list:
        if len(ids) == 1:  # the decode case: one sampled token
            t = ids[0]
            if type(t) is int and t >= 0:
                return list(ids) if copy else ids
        out = list(ids) if copy else ids
    else:
        tolist = getattr(ids, "tolist", None)  # numpy arrays: C-speed conversion to ints
        try:
            out = tolist() if tolist is not None else list(ids)
        except TypeError:
            raise CacheError(f"token ids must be a sequence of ints, got {ids!r}") from None
    if out:
        # min() runs at C speed and raises TypeError on None, str and mixed junk; a
        # per-element type check would triple the cost of admitting a prompt.
        try:
            ok = min(out) >= 0
        except TypeError:
            ok = False
        if not ok:
            raise CacheError(f"token ids must be non-negative ints, got {ids!r}"[:200])
    return out
