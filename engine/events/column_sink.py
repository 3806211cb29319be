"""ColumnSink: the engine thread records a step's events as rows, no map per event.

The engine thread's cost per event is what observability costs a GPU engine, so the
frequent kinds (every typed call of ``engine.events.sink.EventSink``: alloc, free, hit,
store, evict, seq_tokens, seq_add, seq_start, seq_finish) do not become a dict each on
it: a typed call appends one tuple (the kind, then its arguments) and, for a kind that
carries ``blocks``, extends one id list (Python lists, which grow by doubling:
preallocated in effect, and a list ``extend`` is one C copy where a numpy slice
assignment of a list costs a conversion per call). Lists other than ``blocks`` are kept
as handed over (the sink's ownership contract: the caller never changes them again). The
rare kinds (``emit``) are kept as the map ``ListSink`` would keep, in their place.
``drain`` hands the step over in O(1).

The stream thread, off the engine's critical path, turns a ``RecordedStep`` into what
the wire and the readers take: ``events()`` (the maps, exactly those ``ListSink`` would
have collected: ``ListSink`` is the reference, and tests/events/test_column_sink.py
holds the two equal over real cache-manager runs) and, for a bulk step, ``columns()``
(the ``StepColumns`` of protocol 3, built from the rows without a map per block
operation).

Torch-free (numpy only).
"""

from __future__ import annotations

from typing import Any

from kvscope.engine.events import schema as S
from kvscope.engine.events.columns import KIND_CODE, TIER_CODE, StepColumns, _Builder
from kvscope.engine.events.state import pack_ids
from kvscope.engine.events.state_columns import worth_arrays

_OTHER = None  # a row's kind slot for an emitted map: the row is (None, map)


class RecordedStep:
    """One step as the ColumnSink recorded it: rows in order (one per event, see
    ``ColumnSink``), and the block ids of the rows that carry ``blocks``, concatenated.
    Immutable once drained."""

    __slots__ = ("rows", "ids")

    def __init__(self, rows: list[tuple[Any, ...]], ids: list[int]) -> None:
        self.rows = rows
        self.ids = ids

    def __len__(self) -> int:
        return len(self.rows)

    def events(self, packed: bool = False) -> list[dict[str, Any]]:
        """The step's events as maps, in order: what ``ListSink`` collects (the same
        keys in the same order; handed-over lists are shared, not copied). ``packed``:
        the typed rows' ``blocks`` as protocol 2's packed bytes (``pack_ids``: what the
        wire's ``pack_events`` makes of them); the emitted maps stay as they are."""
        ids, out, o = self.ids, [], 0
        append = out.append
        for row in self.rows:
            kind = row[0]
            if kind is _OTHER:
                append(row[1])
            elif kind in _BLOCK_ROWS:
                n = row[4]
                append(_block_event(row, pack_ids(ids[o:o + n]) if packed
                                    else ids[o:o + n]))
                o += n
            else:
                append(_SEQ_EVENT[kind](row))
        return out

    def worth_columns(self) -> bool:
        """Whether the wire carries this step as columns (``state_columns.worth_arrays``
        over its block operations)."""
        return worth_arrays(len(self.rows), len(self.ids))

    def columns(self, with_events: bool = True) -> StepColumns:
        """The step as ``StepColumns`` (what ``StepColumns.from_events(self.events())``
        gives): alloc/free/hit rows straight from the rows, every other event through
        the columns' own builder as its map (a hot kind that fits goes into the
        columns, e.g. not a hash beyond int64; any other map stays one).
        ``with_events``: also build ``events()`` (the result's ``source``); without,
        ``to_events()`` rebuilds them from the columns when asked."""
        b = _Builder()
        ids, o = self.ids, 0
        name, add_row = b._name, b._row
        for row in self.rows:
            kind = row[0]
            if kind is _OTHER:
                ev = row[1]
            elif kind in _BLOCK_ROWS:
                n = row[4]
                blocks = ids[o:o + n]
                o += n
                if kind in _SEQ_BLOCK_OPS:
                    add_row(KIND_CODE[kind], TIER_CODE[row[1]], name(row[2]), row[3],
                            blocks)
                    continue
                ev = _block_event(row, blocks)
            else:
                ev = _SEQ_EVENT[kind](row)
            if not b.add(ev):
                b.other(ev)
        c = b.build()
        c.source = self.events() if with_events else None
        return c


def _block_event(row: tuple[Any, ...], blocks: list[int]) -> dict[str, Any]:
    """The map of a row that carries ``blocks`` (ListSink's keys, in its order)."""
    kind = row[0]
    if kind == S.HIT:
        return {"tier": row[1], "seq": row[2], "blocks": blocks, "tokens": row[3],
                "kind": kind}
    if kind == S.STORE:
        return {"tier": row[1], "blocks": blocks, "hashes": row[3], "kind": kind}
    if kind == S.EVICT:
        if row[3] is None:
            return {"tier": row[1], "blocks": blocks, "kind": kind}
        return {"tier": row[1], "blocks": blocks, "cause": row[3], "kind": kind}
    return {"tier": row[1], "seq": row[2], "blocks": blocks, "kind": kind}


# rows that carry ``blocks``: (kind, tier, seq or None, tokens / hashes / cause, n ids)
_SEQ_BLOCK_OPS = frozenset((S.ALLOC, S.FREE, S.HIT))
_BLOCK_ROWS = _SEQ_BLOCK_OPS | {S.STORE, S.EVICT}
# the other typed rows, (kind, *the typed call's arguments) -> the map ListSink keeps
_SEQ_EVENT = {
    S.SEQ_TOKENS: lambda r: {"seqs": r[1], "num_tokens": r[2], "kind": r[0]},
    S.SEQ_ADD: lambda r: {"seq": r[1], "prompt_tokens": r[2], "priority": r[3],
                          "kind": r[0]},
    S.SEQ_START: lambda r: {"seq": r[1], "kind": r[0]},
    S.SEQ_FINISH: lambda r: {"seq": r[1], "reason": r[2], "num_tokens": r[3],
                             "output_tokens": r[4], "kind": r[0]},
}


class ColumnSink:
    """An ``EventSink`` recording into columns (module docstring). Engine thread only;
    ``drain`` hands the step to another thread."""

    enabled = True
    # as ListSink.store_detail: ``store`` events carry vLLM's detail when True
    store_detail = False

    def __init__(self) -> None:
        self._rows: list[tuple[Any, ...]] = []
        self._ids: list[int] = []

    @property
    def events(self) -> list[tuple[Any, ...]]:
        """The rows recorded since the last ``drain`` (one per event; empty: nothing)."""
        return self._rows

    def emit(self, kind: str, **fields: Any) -> None:
        for key, value in fields.items():
            if type(value) is list:  # the emitter may change it later (see ListSink)
                fields[key] = value.copy()
        fields["kind"] = kind
        self._rows.append((_OTHER, fields))

    def block_op(self, kind: str, tier: str, seq: str, blocks: list[int],
                 tokens: int = 0) -> None:
        """``EventSink.block_op``: one tuple and one list extend (the ids are copied)."""
        self._rows.append((kind, tier, seq, tokens, len(blocks)))
        self._ids += blocks

    def store(self, tier: str, blocks: list[int], hashes: list[int]) -> None:
        """``EventSink.store``: the ids copied, the hashes kept (handed over)."""
        self._rows.append((S.STORE, tier, None, hashes, len(blocks)))
        self._ids += blocks

    def evict(self, tier: str, blocks: list[int], cause: dict[str, Any] | None) -> None:
        """``EventSink.evict``: the ids copied, the cause kept (handed over)."""
        self._rows.append((S.EVICT, tier, None, cause, len(blocks)))
        self._ids += blocks

    def seq_tokens(self, seqs: list[str], num_tokens: list[int]) -> None:
        """``EventSink.seq_tokens``: both lists kept (handed over)."""
        self._rows.append((S.SEQ_TOKENS, seqs, num_tokens))

    def seq_add(self, seq: str, prompt_tokens: int, priority: int) -> None:
        self._rows.append((S.SEQ_ADD, seq, prompt_tokens, priority))

    def seq_start(self, seq: str) -> None:
        self._rows.append((S.SEQ_START, seq))

    def seq_finish(self, seq: str, reason: str, num_tokens: int, output_tokens: int) -> None:
        self._rows.append((S.SEQ_FINISH, seq, reason, num_tokens, output_tokens))

    def drain(self) -> RecordedStep:
        out = RecordedStep(self._rows, self._ids)
        self._rows, self._ids = [], []
        return out
