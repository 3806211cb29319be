"""Prefix view: the prefix cache as a tree of block contents (hash chains seen in prefix
hits), each node with the sequences and hit tokens it served, its age and where it lives
now (gpu/cpu block ids). Roots sorted by tokens saved; selecting a node asks the window
to highlight its blocks (and its descendants') on the block map."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QLabel, QTreeWidget, QTreeWidgetItem, QVBoxLayout, QWidget

from engine.events.lifecycle import LifecycleIndex, PrefixNode

COLUMNS = ("prefix block", "tokens saved", "hits", "sequences", "age (steps)", "tier: block")
MAX_NODES = 5000  # the tree shows the nodes that saved most (a huge cache stays usable)


class PrefixTreeView(QWidget):
    blocks_selected = Signal(dict)  # {tier: [block ids]} of the selected node's subtree

    def __init__(self) -> None:
        super().__init__()
        self.index: LifecycleIndex | None = None
        self.tree = QTreeWidget()
        self.tree.setColumnCount(len(COLUMNS))
        self.tree.setHeaderLabels(COLUMNS)
        self.tree.setSortingEnabled(False)
        self.tree.itemSelectionChanged.connect(self._on_select)
        self.total = QLabel("")
        lay = QVBoxLayout(self)
        lay.addWidget(self.total)
        lay.addWidget(self.tree)

    def set_index(self, index: LifecycleIndex | None) -> None:
        self.index = index
        self.refresh()

    def refresh(self) -> None:
        self.tree.clear()
        idx = self.index
        if idx is None:
            return
        nodes = idx.prefix_nodes()[:MAX_NODES]
        keep = {n.hash for n in nodes}
        items: dict[int, QTreeWidgetItem] = {}
        # parents first (depth order), each level sorted by tokens saved
        for n in sorted(nodes, key=lambda n: (n.depth, -n.tokens_saved)):
            parent = items.get(n.parent) if n.parent in keep else None
            item = QTreeWidgetItem(parent if parent is not None else self.tree,
                                   self._row(idx, n))
            item.setData(0, Qt.ItemDataRole.UserRole, n.hash)
            item.setToolTip(0, f"hash {n.hash:#x} · depth {n.depth} · "
                               f"first hit at step {n.first_step}")
            items[n.hash] = item
        saved = sum(n.tokens_saved for n in idx.prefix.values())
        self.total.setText(f"{len(idx.prefix):,} cached prefix blocks served hits; "
                           f"{saved:,} prompt tokens not recomputed")
        for c in range(len(COLUMNS)):
            self.tree.resizeColumnToContents(c)

    def _row(self, idx: LifecycleIndex, n: PrefixNode) -> list[str]:
        where = [f"{t}:{b}" for t in ("gpu", "cpu")
                 if (b := idx.hash_block[t].get(n.hash)) is not None]
        return [f"#{n.depth} {n.hash & 0xffffff:06x}", f"{n.tokens_saved:,}", f"{n.hits:,}",
                f"{n.num_seqs:,}", f"{max(0, idx.last_step - n.first_step):,}",
                ", ".join(where) or "evicted"]

    def _on_select(self) -> None:
        items = self.tree.selectedItems()
        if not items or self.index is None:
            self.blocks_selected.emit({})
            return
        h = items[0].data(0, Qt.ItemDataRole.UserRole)
        self.blocks_selected.emit(self.index.prefix_blocks(int(h)))
