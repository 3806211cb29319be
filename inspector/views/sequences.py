"""Sequences: a sortable, filterable table of the frame's sequences, the selected
sequence's block table (logical -> physical, with shared and cached-prefix marks) and the
sequences holding the selected block."""

from __future__ import annotations

from typing import Any

import numpy as np
from PySide6.QtCore import (
    QAbstractTableModel,
    QItemSelectionModel,
    QModelIndex,
    QPersistentModelIndex,
    QSortFilterProxyModel,
    Qt,
)
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHeaderView,
    QLabel,
    QLineEdit,
    QListWidget,
    QSplitter,
    QTableView,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from kvscope.engine.events import KVState
from kvscope.inspector import palette as P
from kvscope.inspector.model import InspectorModel

COLUMNS = ("seq", "status", "tier", "prompt", "gen", "blocks", "shared", "hit tok",
           "preempt")
STATUS_COLOURS = {"running": P.OK, "waiting": P.WARN, "swapped": P.SWAPPED}
_Index = QModelIndex | QPersistentModelIndex


def seq_rows(state: KVState) -> list[tuple[Any, ...]]:
    """One row per sequence, in ``COLUMNS`` order (the table's whole content)."""
    rows = []
    for s in state.seqs.values():
        t = state.tiers.get(s.tier)
        table = np.asarray(s.block_table, dtype=np.int64)
        shared = int((t.ref[table] > 1).sum()) if t is not None and table.size else 0
        rows.append((s.seq_id, s.status, s.tier, s.prompt_tokens,
                     max(0, s.num_tokens - s.prompt_tokens), len(s.block_table), shared,
                     s.hit_tokens, s.preemptions))
    return rows


class SeqTableModel(QAbstractTableModel):
    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[Any, ...]] = []

    def set_rows(self, rows: list[tuple[Any, ...]]) -> None:
        self.beginResetModel()
        self.rows = rows
        self.endResetModel()

    def rowCount(self, parent: _Index = QModelIndex()) -> int:  # noqa: B008
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent: _Index = QModelIndex()) -> int:  # noqa: B008
        return len(COLUMNS)

    def data(self, index: _Index, role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        v = self.rows[index.row()][index.column()]
        if role == Qt.ItemDataRole.DisplayRole:
            return f"{v:,}" if isinstance(v, int) else str(v)
        if role == Qt.ItemDataRole.UserRole:  # sort key: numbers sort as numbers
            return v
        if role == Qt.ItemDataRole.ToolTipRole and index.column() == 0:
            return str(v)  # the whole id (the cell elides it in the middle)
        if role == Qt.ItemDataRole.ForegroundRole and index.column() == 1:
            return QColor(STATUS_COLOURS.get(v, P.TEXT))
        if role == Qt.ItemDataRole.TextAlignmentRole and isinstance(v, int):
            return int(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        return None

    def headerData(self, section: int, orientation: Qt.Orientation,
                   role: int = Qt.ItemDataRole.DisplayRole) -> Any:
        if role == Qt.ItemDataRole.DisplayRole and orientation == Qt.Orientation.Horizontal:
            return COLUMNS[section]
        return None


class SequencesView(QWidget):
    def __init__(self, model: InspectorModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self._syncing = False
        self._detail_key: tuple = ()
        self.filter = QLineEdit()
        self.filter.setPlaceholderText("filter sequences (id, status, tier)…")
        self.filter.setClearButtonEnabled(True)
        self.table_model = SeqTableModel()
        self.proxy = QSortFilterProxyModel()
        self.proxy.setSourceModel(self.table_model)
        self.proxy.setSortRole(Qt.ItemDataRole.UserRole)
        self.proxy.setFilterKeyColumn(-1)
        self.proxy.setFilterCaseSensitivity(Qt.CaseSensitivity.CaseInsensitive)
        self.filter.textChanged.connect(self.proxy.setFilterFixedString)
        self.table = QTableView()
        self.table.setModel(self.proxy)
        self.table.setSortingEnabled(True)
        self.table.sortByColumn(0, Qt.SortOrder.AscendingOrder)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.table.setAlternatingRowColors(True)
        # ids such as chatcmpl-<32 hex>-0 differ at both ends: keep both visible
        self.table.setTextElideMode(Qt.TextElideMode.ElideMiddle)
        # No word wrap: wrapped, "chatcmpl-a78...-0" breaks after the hyphen (Unicode line
        # breaking allows it before a letter, not before a digit), the 20 px row shows only
        # the first line, and the cell reads "chatcmpl-..." for every such id.
        self.table.setWordWrap(False)
        self.table.verticalHeader().hide()
        self.table.verticalHeader().setDefaultSectionSize(20)
        self.table.setStyleSheet("font-size: 9pt;")
        # Fixed widths: ResizeToContents measures every row on each frame (slow at 1000s).
        h = self.table.horizontalHeader()
        for c, width in enumerate((84, 70, 44, 58, 52, 52, 54, 62, 60)):
            h.setSectionResizeMode(c, QHeaderView.ResizeMode.Interactive)
            h.resizeSection(c, width)
        h.setStretchLastSection(True)
        self.table.selectionModel().selectionChanged.connect(self._on_row_selected)

        self.detail_title = QLabel("select a sequence to see its block table")
        self.detail_title.setStyleSheet(f"color: {P.TEXT_DIM};")
        self.detail_title.setWordWrap(True)  # a long id wraps; it must not widen the panel
        self.block_table = QTableWidget(0, 4)
        self.block_table.setHorizontalHeaderLabels(["logical", "physical", "ref", "mark"])
        self.block_table.verticalHeader().hide()
        self.block_table.verticalHeader().setDefaultSectionSize(18)
        self.block_table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.block_table.horizontalHeader().setStretchLastSection(True)
        self.block_table.itemSelectionChanged.connect(self._on_block_row_selected)
        self.owners_title = QLabel("click a block to list its sequences")
        self.owners_title.setStyleSheet(f"color: {P.TEXT_DIM};")
        self.owners = QListWidget()
        self.owners.itemClicked.connect(lambda it: self.model.select_seq(it.text()))

        detail = QWidget()
        dl = QVBoxLayout(detail)
        dl.setContentsMargins(0, 0, 0, 0)
        dl.addWidget(self.detail_title)
        dl.addWidget(self.block_table, 3)
        dl.addWidget(self.owners_title)
        dl.addWidget(self.owners, 1)
        top = QWidget()
        tl = QVBoxLayout(top)
        tl.setContentsMargins(0, 0, 0, 0)
        tl.addWidget(self.filter)
        tl.addWidget(self.table)
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(top)
        split.addWidget(detail)
        split.setSizes([300, 260])
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addWidget(split)

        model.state_changed.connect(self.refresh)
        model.selection_changed.connect(self._sync_selection)

    # ------------------------------------------------------------- drawing
    def refresh(self) -> None:
        self._syncing = True
        try:
            self.table_model.set_rows(seq_rows(self.model.state))
            self._select_row(self.model.selected_seq)
        finally:
            self._syncing = False
        self._draw_detail()

    def visible_rows(self) -> list[tuple[Any, ...]]:
        """Rows as shown (after filter and sort), for tests."""
        out = []
        for r in range(self.proxy.rowCount()):
            src = self.proxy.mapToSource(self.proxy.index(r, 0))
            out.append(self.table_model.rows[src.row()])
        return out

    def _select_row(self, seq_id: str | None) -> None:
        sm = self.table.selectionModel()
        if seq_id is None:
            sm.clearSelection()
            return
        for r in range(self.proxy.rowCount()):
            idx = self.proxy.index(r, 0)
            if idx.data() == seq_id:
                sm.select(idx, QItemSelectionModel.SelectionFlag.ClearAndSelect
                          | QItemSelectionModel.SelectionFlag.Rows)
                self.table.scrollTo(idx)
                return
        sm.clearSelection()

    def _sync_selection(self) -> None:
        self._syncing = True
        try:
            self._select_row(self.model.selected_seq)
        finally:
            self._syncing = False
        self._draw_detail()

    def _draw_detail(self) -> None:
        st, sid = self.model.state, self.model.selected_seq
        s = st.seqs.get(sid) if sid is not None else None
        key = (self.model.frame, sid)
        if key == self._detail_key:
            self._draw_owners()
            return
        self._detail_key = key
        self.block_table.blockSignals(True)
        if s is None:
            self.detail_title.setText("select a sequence to see its block table")
            self.block_table.setRowCount(0)
        else:
            t = st.tiers[s.tier]
            self.detail_title.setText(
                f"<b style='color:{P.owner_colour(s.seq_id)}'>{s.seq_id}</b> · {s.status} · "
                f"{s.tier} · {s.num_tokens} tokens in {len(s.block_table)} blocks")
            self.block_table.setRowCount(len(s.block_table))
            for i, b in enumerate(s.block_table):
                ref = int(t.ref[b])
                marks = []
                if ref > 1:
                    marks.append("shared")
                if b in t.hashes:
                    marks.append("cached prefix")
                colour = P.SHARED if ref > 1 else (P.CACHED if b in t.hashes else P.TEXT)
                for c, text in enumerate((str(i), str(b), str(ref), ", ".join(marks))):
                    item = QTableWidgetItem(text)
                    item.setForeground(QColor(colour if c == 3 else P.TEXT))
                    self.block_table.setItem(i, c, item)
        self.block_table.blockSignals(False)
        self._draw_owners()

    def _draw_owners(self) -> None:
        st = self.model.state
        self.owners.clear()
        blk = self.model.selected_block
        if blk is None:
            self.owners_title.setText("click a block to list its sequences")
        else:
            owners = st.owners(*blk)
            self.owners_title.setText(
                f"{blk[0].upper()} block {blk[1]}: held by {len(owners)} sequence(s)")
            self.owners.addItems(owners)

    # ------------------------------------------------------------ user input
    def _on_row_selected(self) -> None:
        if self._syncing:
            return
        rows = self.table.selectionModel().selectedRows()
        sid = rows[0].data() if rows else None
        self.model.select_block(None)
        self.model.select_seq(sid)

    def _on_block_row_selected(self) -> None:
        st, sid = self.model.state, self.model.selected_seq
        s = st.seqs.get(sid) if sid is not None else None
        rows = self.block_table.selectionModel().selectedRows()
        if s is None or not rows:
            return
        # Keep the sequence selected (its blocks stay highlighted); list the block's owners.
        self.model.select_block(s.tier, s.block_table[rows[0].row()])
