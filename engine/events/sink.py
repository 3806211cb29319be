"""Event sinks: where the cache manager (and scheduler) report each state change.

The cache manager calls ``sink.emit(kind, **fields)`` for every change (fields as in
``engine.events.schema``; block ids as plain Python int lists, never numpy arrays), and
``sink.block_op(kind, tier, seq, blocks, tokens)`` for the hot block operations of a
group-0 table (``alloc``, ``free``, ``hit``): the same event, without building its
fields (``ListSink`` turns it into the ``emit`` it stands for: the reference;
``engine.events.column_sink.ColumnSink`` records it into columns). Emitters check
``sink.enabled`` first and skip building the fields when it is False, so an engine
nobody watches pays one attribute read per change.
"""

from __future__ import annotations

from typing import Any, Protocol

from engine.events.schema import HIT


class EventSink(Protocol):
    enabled: bool

    def emit(self, kind: str, **fields: Any) -> None: ...

    def block_op(self, kind: str, tier: str, seq: str, blocks: list[int],
                 tokens: int = 0) -> None:
        """``emit(kind, tier=tier, seq=seq, blocks=blocks)`` for ``alloc`` and ``free``,
        plus ``tokens=tokens`` for ``hit``. ``blocks`` may be changed after the call."""
        ...


class NullSink:
    """The default: nobody listens."""

    enabled = False

    def emit(self, kind: str, **fields: Any) -> None:
        pass

    def block_op(self, kind: str, tier: str, seq: str, blocks: list[int],
                 tokens: int = 0) -> None:
        pass


class ListSink:
    """Collects events in order; ``drain()`` hands over the step's events.

    List-valued fields are copied at emit time: an emitter may go on mutating the list
    it passed (``seq.block_table.append(...)`` next step) while the event still waits in
    a queue to be encoded on another thread (the EventStream's publisher).
    """

    enabled = True
    # When True, ``store`` events also carry ``parents`` and ``tokens`` (per block: the
    # parent's chain hash, None for a first block; the block's token ids), for a
    # consumer that needs them (vLLM's BlockStored). Off, emitters skip building them.
    store_detail = False

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        for key, value in fields.items():
            if type(value) is list:
                fields[key] = value.copy()
        fields["kind"] = kind
        self.events.append(fields)

    def block_op(self, kind: str, tier: str, seq: str, blocks: list[int],
                 tokens: int = 0) -> None:
        """The per-event reference of ``EventSink.block_op``."""
        if kind == HIT:
            self.emit(kind, tier=tier, seq=seq, blocks=blocks, tokens=tokens)
        else:
            self.emit(kind, tier=tier, seq=seq, blocks=blocks)

    def drain(self) -> list[dict[str, Any]]:
        out, self.events = self.events, []
        return out
