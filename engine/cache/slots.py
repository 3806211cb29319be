"""Slot mappings: token positions -> flat slot ids (``block_id * block_size + offset``)."""

from __future__ import annotations


def slot_mapping(table: list[int], bs: int, start: int, end: int) -> list[int]:
    """Slots of token positions [start, end) (end > start) of a sequence with block table
    ``table``. Runs of consecutive block ids become one ``range``: a table that is one run
    (a fresh pool, or blocks evicted together) costs a single C-level list build."""
    i = start // bs
    last = (end - 1) // bs
    first_block = table[i]
    span = table[i:last + 1]
    if span[-1] - first_block == last - i and span == list(range(first_block, span[-1] + 1)):
        return list(range(first_block * bs + start - i * bs, span[-1] * bs + end - last * bs))
    out: list[int] = []
    lo = first_block * bs + start - i * bs  # current run: [lo, hi)
    hi = first_block * bs + bs
    for b in span[1:]:
        b *= bs
        if b != hi:
            out += range(lo, hi)
            lo = b
        hi = b + bs
    out += range(lo, hi - ((last + 1) * bs - end))
    return out
