"""ColumnSink: the engine thread records a step's block operations as columns.

The engine thread's cost per event is what observability costs a GPU engine, so the hot
block operations of a table (``alloc``, ``free``, ``hit``: most of a step's events) do
not become a dict each on it: ``block_op`` appends one tuple ``(kind, tier, seq, tokens,
number of ids)`` and extends one id list, the step's columns in row form (Python lists,
which grow by doubling: preallocated in effect, and a list ``extend`` is one C copy where
a numpy slice assignment of a list costs a conversion per call). Every other event
(``emit``) is kept as the map ``ListSink`` would keep, in its place. ``drain`` hands the
step over in O(1).

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

from engine.events import schema as S
from engine.events.columns import KIND_CODE, TIER_CODE, StepColumns, _Builder
from engine.events.state_columns import worth_arrays

_OTHER = None  # a row's kind slot for an emitted map: the row is (None, map)


class RecordedStep:
    """One step as the ColumnSink recorded it: rows in order, and the block ids of the
    block-operation rows, concatenated. Immutable once drained."""

    __slots__ = ("rows", "ids")

    def __init__(self, rows: list[tuple[Any, ...]], ids: list[int]) -> None:
        self.rows = rows
        self.ids = ids

    def __len__(self) -> int:
        return len(self.rows)

    def events(self) -> list[dict[str, Any]]:
        """The step's events as maps, in order: what ``ListSink`` collects."""
        ids, out, o = self.ids, [], 0
        for row in self.rows:
            kind = row[0]
            if kind is _OTHER:
                out.append(row[1])
                continue
            n = row[4]
            if kind == S.HIT:
                out.append({"tier": row[1], "seq": row[2], "blocks": ids[o:o + n],
                            "tokens": row[3], "kind": kind})
            else:
                out.append({"tier": row[1], "seq": row[2], "blocks": ids[o:o + n],
                            "kind": kind})
            o += n
        return out

    def worth_columns(self) -> bool:
        """Whether the wire carries this step as columns (``state_columns.worth_arrays``
        over its block operations)."""
        return worth_arrays(len(self.rows), len(self.ids))

    def columns(self, with_events: bool = True) -> StepColumns:
        """The step as ``StepColumns`` (what ``StepColumns.from_events(self.events())``
        gives): block-operation rows straight from the rows, emitted maps through the
        columns' own builder (a hot kind that fits goes into the columns, any other map
        stays one). ``with_events``: also build ``events()`` (the result's ``source``);
        without, ``to_events()`` rebuilds them from the columns when asked."""
        b = _Builder()
        ids, o = self.ids, 0
        for row in self.rows:
            kind = row[0]
            if kind is _OTHER:
                if not b.add(row[1]):
                    b.other(row[1])
                continue
            n = row[4]
            b._row(KIND_CODE[kind], TIER_CODE[row[1]], b._name(row[2]), row[3],
                   ids[o:o + n])
            o += n
        c = b.build()
        c.source = self.events() if with_events else None
        return c


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

    def drain(self) -> RecordedStep:
        out = RecordedStep(self._rows, self._ids)
        self._rows, self._ids = [], []
        return out
