"""Event sinks: where the cache manager (and scheduler) report each state change.

The cache manager reports the frequent kinds through typed calls that build no map on
the engine thread: ``block_op`` (``alloc``, ``free``, ``hit`` of a group-0 table),
``store`` and ``evict`` (group 0, no vLLM detail), ``seq_tokens``, ``seq_add`` (not a
fork's), ``seq_start`` and ``seq_finish``; every other change as ``sink.emit(kind,
**fields)`` (fields as in ``engine.events.schema``; block ids as plain Python int lists,
never numpy arrays). A typed call means exactly the ``emit`` named in its docstring
(``ListSink`` turns each into that ``emit``: the reference; ``engine.events.column_sink.
ColumnSink`` records it as a row). Emitters check ``sink.enabled`` first and skip
building the fields when it is False, so an engine nobody watches pays one attribute
read per change.

Ownership (the typed calls): a list passed as ``blocks`` may be changed by the caller
after the call (sinks copy it: one C-level list copy); every other list (``hashes``,
``seqs``, ``num_tokens``) and the ``cause`` map are handed over: the caller builds them
for the call and never touches them again (the sink keeps them as they are, to be read
on another thread). ``emit`` copies its list-valued fields (the caller may go on
mutating them).
"""

from __future__ import annotations

from typing import Any, Protocol

from kvscope.engine.events import schema as S


class EventSink(Protocol):
    enabled: bool

    def emit(self, kind: str, **fields: Any) -> None: ...

    def block_op(self, kind: str, tier: str, seq: str, blocks: list[int],
                 tokens: int = 0) -> None:
        """``emit(kind, tier=tier, seq=seq, blocks=blocks)`` for ``alloc`` and ``free``,
        plus ``tokens=tokens`` for ``hit``."""
        ...

    def store(self, tier: str, blocks: list[int], hashes: list[int]) -> None:
        """``emit("store", tier=tier, blocks=blocks, hashes=hashes)`` (hashes handed
        over)."""
        ...

    def evict(self, tier: str, blocks: list[int], cause: dict[str, Any] | None) -> None:
        """``emit("evict", tier=tier, blocks=blocks, cause=cause)``; without ``cause``
        when it is None (cause handed over)."""
        ...

    def seq_tokens(self, seqs: list[str], num_tokens: list[int]) -> None:
        """``emit("seq_tokens", seqs=seqs, num_tokens=num_tokens)`` (both handed over)."""
        ...

    def seq_add(self, seq: str, prompt_tokens: int, priority: int) -> None:
        """``emit("seq_add", seq=seq, prompt_tokens=prompt_tokens, priority=priority)``."""
        ...

    def seq_start(self, seq: str) -> None:
        """``emit("seq_start", seq=seq)``."""
        ...

    def seq_finish(self, seq: str, reason: str, num_tokens: int, output_tokens: int) -> None:
        """``emit("seq_finish", seq=seq, reason=reason, num_tokens=num_tokens,
        output_tokens=output_tokens)``."""
        ...


class NullSink:
    """The default: nobody listens."""

    enabled = False

    def emit(self, kind: str, **fields: Any) -> None:
        pass

    def block_op(self, kind: str, tier: str, seq: str, blocks: list[int],
                 tokens: int = 0) -> None:
        pass

    def store(self, tier: str, blocks: list[int], hashes: list[int]) -> None:
        pass

    def evict(self, tier: str, blocks: list[int], cause: dict[str, Any] | None) -> None:
        pass

    def seq_tokens(self, seqs: list[str], num_tokens: list[int]) -> None:
        pass

    def seq_add(self, seq: str, prompt_tokens: int, priority: int) -> None:
        pass

    def seq_start(self, seq: str) -> None:
        pass

    def seq_finish(self, seq: str, reason: str, num_tokens: int, output_tokens: int) -> None:
        pass


class ListSink:
    """Collects events in order; ``drain()`` hands over the step's events. The reference
    meaning of every typed call (each is the ``emit`` its docstring names).

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
        if kind == S.HIT:
            self.emit(kind, tier=tier, seq=seq, blocks=blocks, tokens=tokens)
        else:
            self.emit(kind, tier=tier, seq=seq, blocks=blocks)

    def store(self, tier: str, blocks: list[int], hashes: list[int]) -> None:
        self.emit(S.STORE, tier=tier, blocks=blocks, hashes=hashes)

    def evict(self, tier: str, blocks: list[int], cause: dict[str, Any] | None) -> None:
        if cause is None:
            self.emit(S.EVICT, tier=tier, blocks=blocks)
        else:
            self.emit(S.EVICT, tier=tier, blocks=blocks, cause=cause)

    def seq_tokens(self, seqs: list[str], num_tokens: list[int]) -> None:
        self.emit(S.SEQ_TOKENS, seqs=seqs, num_tokens=num_tokens)

    def seq_add(self, seq: str, prompt_tokens: int, priority: int) -> None:
        self.emit(S.SEQ_ADD, seq=seq, prompt_tokens=prompt_tokens, priority=priority)

    def seq_start(self, seq: str) -> None:
        self.emit(S.SEQ_START, seq=seq)

    def seq_finish(self, seq: str, reason: str, num_tokens: int, output_tokens: int) -> None:
        self.emit(S.SEQ_FINISH, seq=seq, reason=reason, num_tokens=num_tokens,
                  output_tokens=output_tokens)

    def drain(self) -> list[dict[str, Any]]:
        out, self.events = self.events, []
        return out
