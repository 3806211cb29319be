"""Slot mappings: token positions -> flat slot ids (``block_id * block_size + offset``)."""

from __future__ import annotations


def slot_mapping(table: list[int], bs: int, start: int, end: int) -> list[int]:
    """Slots of token positions [start, end) (end > start): runs of consecutive blocks
    become one ``range``, so a fresh pool's prefill costs a few C-level extends."""
    out: list[int] = []
    i = start // bs
    last = (end - 1) // bs
    lo = table[i] * bs + start - i * bs  # current run: [lo, hi)
    hi = table[i] * bs + bs
    for j in range(i + 1, last + 1):
        b = table[j] * bs
        if b != hi:
            out += range(lo, hi)
            lo = b
        hi = b + bs
    out += range(lo, hi - ((last + 1) * bs - end))
    return out
