"""Event sinks: where the cache manager (and scheduler) report each state change.

The cache manager calls ``sink.emit(kind, **fields)`` for every change (fields as in
``engine.events.schema``; block ids as plain Python int lists, never numpy arrays).
Emitters check ``sink.enabled`` first and skip building the fields when it is False,
so an engine nobody watches pays one attribute read per change.
"""

from __future__ import annotations

from typing import Any, Protocol


class EventSink(Protocol):
    enabled: bool

    def emit(self, kind: str, **fields: Any) -> None: ...


class NullSink:
    """The default: nobody listens."""

    enabled = False

    def emit(self, kind: str, **fields: Any) -> None:
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

    def drain(self) -> list[dict[str, Any]]:
        out, self.events = self.events, []
        return out
