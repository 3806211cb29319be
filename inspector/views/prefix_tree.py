"""Prefix view: the prefix cache as a tree of block contents (hash chains seen in prefix
hits), each node with the sequences and hit tokens it served, its age and where it lives
now (gpu/cpu block ids). A row is a chain of blocks always hit together (a radix-tree edge);
siblings sorted by tokens saved. Selecting a row highlights its blocks on the block map
(as they are at the step shown)."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QLabel, QTreeWidget, QTreeWidgetItem, QVBoxLayout, QWidget

from kvscope.engine.events.analysis.lifecycle import LifecycleIndex, PrefixNode

COLUMNS = ("prefix blocks", "tokens saved", "hits", "sequences", "age (steps)",
           "where (latest step)")
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
        nodes = {n.hash: n for n in idx.prefix_nodes()[:MAX_NODES]}

        def children(n: PrefixNode) -> list[PrefixNode]:
            return sorted((nodes[c] for c in n.children if c in nodes),
                          key=lambda c: -c.tokens_saved)

        def segment(n: PrefixNode) -> list[PrefixNode]:
            # A chain of blocks that always served together is one row (a radix-tree edge).
            seg = [n]
            while (kids := children(seg[-1])) and len(kids) == 1 and kids[0].hits == n.hits:
                seg.append(kids[0])
            return seg

        def by_saved(ns: list[PrefixNode]) -> list[list[PrefixNode]]:
            segs = [segment(n) for n in ns]
            return sorted(segs, key=lambda sg: -sum(x.tokens_saved for x in sg))

        def add(parent: QTreeWidgetItem | None, seg: list[PrefixNode]) -> None:
            n = seg[0]
            item = QTreeWidgetItem(parent if parent is not None else self.tree,
                                   self._row(idx, seg))
            item.setData(0, Qt.ItemDataRole.UserRole, [x.hash for x in seg])
            item.setToolTip(0, f"{len(seg)} block(s) from depth {n.depth}; first hit at step "
                               f"{n.first_step}; hashes " + ", ".join(
                                   f"{x.hash & 0xffffff:06x}" for x in seg[:8]))
            for c in by_saved(children(seg[-1])):
                add(item, c)

        for r in by_saved([n for n in nodes.values() if n.parent not in nodes]):
            add(None, r)
        self.tree.expandAll()
        saved = sum(n.tokens_saved for n in idx.prefix.values())
        self.total.setText(f"{len(idx.prefix):,} cached prefix blocks served hits; "
                           f"{saved:,} prompt tokens not recomputed · a row is a chain of "
                           "blocks that were always hit together")
        for c in range(len(COLUMNS)):
            self.tree.resizeColumnToContents(c)

    def _row(self, idx: LifecycleIndex, seg: list[PrefixNode]) -> list[str]:
        n = seg[0]
        where = []
        for t in ("gpu", "cpu"):
            blocks = [b for x in seg if (b := idx.hash_block[t].get(x.hash)) is not None]
            if blocks:
                where.append(f"{t}: " + ", ".join(map(str, blocks[:12]))
                             + (" …" if len(blocks) > 12 else ""))
        depth = f"#{n.depth}" if len(seg) == 1 else f"#{n.depth}–{seg[-1].depth}"
        return [f"{depth} · {len(seg)} block{'s' if len(seg) != 1 else ''}",
                f"{sum(x.tokens_saved for x in seg):,}", f"{n.hits:,}", f"{n.num_seqs:,}",
                f"{max(0, idx.last_step - n.first_step):,}", " · ".join(where) or "evicted"]

    def _on_select(self) -> None:
        items = self.tree.selectedItems()
        if not items or self.index is None:
            self.blocks_selected.emit({})
            return
        hashes = set(items[0].data(0, Qt.ItemDataRole.UserRole))
        self.blocks_selected.emit({t: [b for h, b in self.index.hash_block[t].items()
                                       if h in hashes] for t in self.index.hash_block})

    def selected_hashes(self) -> set[int]:
        """The block contents (hashes) of the selected row's chain."""
        items = self.tree.selectedItems()
        return set(items[0].data(0, Qt.ItemDataRole.UserRole)) if items else set()
