"""InspectorModel: what the views draw. One KVState frame, the run's timeline, the
recent event log and the user's selection.

Sources replace the frame (``set_state``) and append to the timeline and log; views listen
to the signals and redraw. Everything here lives on the GUI thread.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from PySide6.QtCore import QObject, Signal

from kvscope.engine.events import KVState
from kvscope.engine.events.analysis.lifecycle import LifecycleIndex
from kvscope.inspector.timeline import Timeline

EVENT_LOG_SIZE = 20_000


class InspectorModel(QObject):
    state_changed = Signal()
    timeline_changed = Signal()
    events_added = Signal(list)  # [(step, event), ...] in order
    events_reset = Signal()
    selection_changed = Signal()
    # the step shown (replay cursor or live head). object, not int: Signal(int) is a C int
    # (32 bits) and a step is any int64 of the protocol (2**63 - 1 overflowed it)
    cursor_changed = Signal(object)

    def __init__(self) -> None:
        super().__init__()
        self.state = KVState()
        self.timeline = Timeline()
        self.events: deque[tuple[int, dict[str, Any]]] = deque(maxlen=EVENT_LOG_SIZE)
        self.selected_seq: str | None = None
        self.selected_block: tuple[str, int] | None = None
        self.frame = 0  # bumps on every set_state, so views can skip unchanged redraws
        self.lifecycle = LifecycleIndex()  # live sources grow it (replay: the recording's)
        self.highlight: dict[str, list[int]] | None = None  # e.g. a prefix-tree node
        self._owners_key: tuple | None = None  # _owners' cache: the selected block's holders
        self._owners_of: list[str] = []

    def set_highlight(self, blocks: dict[str, list[int]] | None) -> None:
        """Blocks to keep bright (per tier), over any selection; None: back to normal."""
        self.highlight = blocks
        self.selection_changed.emit()

    # --------------------------------------------------------------- frames
    def set_state(self, state: KVState) -> None:
        """Show ``state``. Selections that no longer exist are dropped."""
        self.state = state
        self.frame += 1
        changed = False
        if self.selected_seq is not None and self.selected_seq not in state.seqs:
            self.selected_seq, changed = None, True
        if self.selected_block is not None:
            tier, b = self.selected_block
            t = state.tiers.get(tier)
            if t is None or b >= t.num_blocks:
                self.selected_block, changed = None, True
        self.state_changed.emit()
        self.cursor_changed.emit(state.step)
        if changed:
            self.selection_changed.emit()

    def add_events(self, batches: list[dict[str, Any]]) -> None:
        rows = [(int(b.get("step", -1)), ev) for b in batches for ev in b.get("events", ())]
        if rows:
            self.events.extend(rows)
            self.events_added.emit(rows)

    def reset_events(self, batches: list[dict[str, Any]]) -> None:
        self.events.clear()
        self.events.extend((int(b.get("step", -1)), ev) for b in batches
                           for ev in b.get("events", ()))
        self.events_reset.emit()

    # ------------------------------------------------------------ selection
    def select_seq(self, seq_id: str | None) -> None:
        if seq_id == self.selected_seq:
            return
        self.selected_seq = seq_id
        self.selection_changed.emit()

    def select_block(self, tier: str | None, block: int | None = None) -> None:
        sel = None if tier is None or block is None else (tier, int(block))
        if sel == self.selected_block:
            return
        self.selected_block = sel
        self.selection_changed.emit()

    def highlighted_blocks(self, tier: str) -> list[int] | None:
        """Blocks to keep bright on ``tier``'s map, or None when nothing is selected.

        An explicit highlight first (``set_highlight``); else the selected sequence's
        table (on a cache group's pool, ``gpu/1``: its table in that group); else the
        tables of the selected block's owners."""
        st = self.state
        if self.highlight is not None:
            return list(self.highlight.get(tier, []))
        base, _, group = tier.partition("/")  # a cache group's pool: "gpu/1"
        if self.selected_seq is not None:
            s = st.seqs.get(self.selected_seq)
            if s is None:
                return None
            if group:
                return list(s.group_tables.get(int(group), [])) if s.tier == base else []
            return list(s.block_table) if s.tier == tier else []
        if self.selected_block is not None:
            btier, b = self.selected_block
            out: list[int] = [b] if btier == tier else []
            for sid in self._owners(btier, b):
                s = st.seqs[sid]
                if s.tier == tier:
                    out.extend(s.block_table)
            return out
        return None

    def _owners(self, tier: str, block: int) -> list[str]:
        """``state.owners(tier, block)``, a scan of every sequence, remembered while the
        block is unchanged: a table takes or drops a block only by changing its ref
        count, which stamps the block's last-change step (``touched``). Keyed on the
        sequence dict too (a replay's seek builds a new one; live frames patch theirs)."""
        st = self.state
        t = st.tiers.get(tier)
        stamp = int(t.touched[block]) if t is not None and 0 <= block < t.num_blocks else None
        key = (id(st.seqs), tier, block, stamp)
        if key != self._owners_key:
            self._owners_key, self._owners_of = key, st.owners(tier, block)
        return self._owners_of
