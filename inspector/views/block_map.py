"""Physical block map: one cell per physical block, one panel per tier.

Each tier is a uint8 ``ImageItem`` over a small LUT (``inspector.palette``): Qt's Indexed8
fast path, smooth at 1M blocks. Invariants: both image sides stay <= 32767 and
autoDownsample stays off (downsampling would AVERAGE category codes into nonsense), and
the cell of block ``b`` is ``(row, col) = divmod(b, width)``.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, Qt, Signal
from PySide6.QtGui import QCursor
from PySide6.QtWidgets import QCheckBox, QHBoxLayout, QLabel, QToolTip, QVBoxLayout, QWidget

from engine.events import KVState
from engine.events import schema as S
from inspector import palette as P
from inspector.model import InspectorModel

MAX_SIDE = 32767


def grid_width(num_blocks: int, aspect: float = 1.6) -> int:
    """Columns of a tier's grid: roughly ``aspect`` times wider than tall, <= MAX_SIDE."""
    if num_blocks <= 0:
        return 1
    w = math.ceil(math.sqrt(num_blocks * aspect))
    w = max(w, math.ceil(num_blocks / MAX_SIDE))
    return min(w, MAX_SIDE)


@functools.lru_cache(maxsize=1 << 16)
def _slot(seq_id: str) -> int:
    return P.owner_index(seq_id)


def owner_slots(state: KVState, tier: str) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, colour slots) for every block-table entry in ``tier``, for owner colouring."""
    seqs = [s for s in state.seqs.values() if s.tier == tier and s.block_table]
    lens = np.fromiter((len(s.block_table) for s in seqs), dtype=np.int64, count=len(seqs))
    total = int(lens.sum())
    blocks = np.fromiter(itertools.chain.from_iterable(s.block_table for s in seqs),
                         dtype=np.int64, count=total)
    slots = np.fromiter((_slot(s.seq_id) for s in seqs), dtype=np.uint8, count=len(seqs))
    return blocks, np.repeat(slots, lens)


# code -> its dimmed code (a selection is active and the cell is not in it), as one
# table lookup over the whole map instead of boolean masks.
_DIM = np.arange(256, dtype=np.uint8)
_DIM[: P.DIM_OFFSET] += P.DIM_OFFSET
_DIM[P.OWNER_BASE: P.OWNER_DIM_BASE] += P.OWNER_DIM_BASE - P.OWNER_BASE


def mark_demoted(state: KVState, tier: str, codes: np.ndarray) -> np.ndarray:
    """Used/shared blocks whose own format differs from the tier's (``quantize``) get the
    demoted codes, in place; returns ``codes``."""
    formats = state.tiers[tier].formats
    if formats:
        idx = np.fromiter(formats.keys(), dtype=np.int64, count=len(formats))
        sub = codes[idx]
        sub[sub == S.BLOCK_USED] = P.CODE_DEMOTED_USED
        sub[sub == S.BLOCK_SHARED] = P.CODE_DEMOTED_SHARED
        codes[idx] = sub
    return codes


def cell_codes(state: KVState, tier: str, *, by_owner: bool = False,
               highlight: list[int] | None = None, selected: int | None = None,
               codes: np.ndarray | None = None) -> np.ndarray:
    """The 1-D LUT codes of ``tier``'s cells (length num_blocks), as the map draws them.

    ``codes``: ``state.block_codes(tier)`` if the caller already has it (it is modified)."""
    codes = mark_demoted(state, tier, state.block_codes(tier)) if codes is None else codes
    if by_owner:
        blocks, slots = owner_slots(state, tier)
        single = codes[blocks] == S.BLOCK_USED  # ref 1: exactly one owner
        codes[blocks[single]] = P.OWNER_BASE + slots[single]
    if highlight is not None:
        keep = np.asarray(highlight, dtype=np.int64)
        bright = codes[keep]
        codes = _DIM[codes]
        codes[keep] = bright
    if selected is not None and 0 <= selected < codes.size:
        codes[selected] = P.CODE_SELECTED
    return codes


def describe_block(state: KVState, tier: str, block: int,
                   code: int | None = None) -> dict[str, Any]:
    """What the hover tooltip shows about one block (read from the KVState frame).

    ``code``: the block's ``block_codes`` entry if the caller has it (saves a full pass)."""
    t = state.tiers[tier]
    owners = state.owners(tier, block)
    filled = 0
    for sid in owners:
        s = state.seqs[sid]
        i = s.block_table.index(block)
        filled = max(filled, min(t.block_size, max(0, s.num_tokens - i * t.block_size)))
    h = t.hashes.get(block)
    if not owners and h is not None:
        filled = t.block_size  # only full blocks enter the prefix cache
    if code is None:
        code = int(mark_demoted(state, tier, state.block_codes(tier))[block])
    return {
        "tier": tier, "block": block, "state": P.state_labels(tier, t.format)[code],
        "ref": int(t.ref[block]), "filled": filled, "block_size": t.block_size,
        "hash": h, "format": t.formats.get(block, t.format), "owners": owners,
    }


def format_block(info: dict[str, Any]) -> str:
    h = "—" if info["hash"] is None else f"{info['hash'] & 0xFFFFFFFFFFFFFFFF:016x}"
    owners = ", ".join(info["owners"][:8]) or "—"
    if len(info["owners"]) > 8:
        owners += f" … (+{len(info['owners']) - 8})"
    return (f"{info['tier'].upper()} block {info['block']} · {info['state']}\n"
            f"ref {info['ref']} · tokens {info['filled']}/{info['block_size']} · "
            f"format {info['format']}\nhash {h}\nowners: {owners}")


class _TierPanel:
    """One tier's title, view box and image."""

    def __init__(self, layout: pg.GraphicsLayout, col: int, tier: str) -> None:
        self.tier = tier
        self.title = layout.addLabel("", row=0, col=col, color=P.TEXT, size="10pt")
        self.view: pg.ViewBox = layout.addViewBox(row=1, col=col)
        self.view.setAspectLocked(True)
        self.view.invertY(True)
        self.view.setMenuEnabled(False)
        self.view.setBackgroundColor(P.PANEL)
        self.image = pg.ImageItem(axisOrder="row-major")
        self.image.setAutoDownsample(False)
        self.view.addItem(self.image)
        self.width = 1
        self.num_blocks = -1
        self.fmt = ""
        self.cells = np.zeros((1, 1), dtype=np.uint8)
        self.base = np.zeros(0, dtype=np.uint8)  # KVState.block_codes of the frame drawn

    def configure(self, num_blocks: int, block_size: int, fmt: str) -> None:
        if (num_blocks, fmt) == (self.num_blocks, self.fmt):
            return
        self.num_blocks, self.fmt = num_blocks, fmt
        self.width = grid_width(num_blocks)
        rows = max(1, math.ceil(num_blocks / self.width))
        self.cells = np.full((rows, self.width), P.CODE_PAD, dtype=np.uint8)
        self.image.setLookupTable(P.block_lut(self.tier, fmt))
        name = {"gpu": "GPU (device)", "cpu": "CPU (host)"}.get(self.tier, self.tier)
        self.title.setText(f"<b>{name}</b> · {num_blocks:,} blocks × {block_size} tok · {fmt}")
        self.image.setImage(self.cells, autoLevels=False, levels=(0, P.LUT_SIZE),
                            autoDownsample=False)
        self.view.setRange(xRange=(0, self.width), yRange=(0, rows), padding=0.02)

    def draw(self, codes: np.ndarray) -> None:
        flat = self.cells.reshape(-1)
        flat[: codes.size] = codes
        self.image.setImage(self.cells, autoLevels=False, levels=(0, P.LUT_SIZE),
                            autoDownsample=False)

    def block_at(self, x: float, y: float) -> int | None:
        """Block under view coordinates (x = column, y = row), or None off the grid."""
        if x < 0 or y < 0:
            return None
        col, row = int(x), int(y)
        if col >= self.width:
            return None
        b = row * self.width + col
        return b if b < self.num_blocks else None


class BlockMapView(QWidget):
    """Draws ``model.state``'s tiers; hover describes a block, click selects it."""

    hovered = Signal(str)  # the hover text ("" when off the grid)

    def __init__(self, model: InspectorModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self.canvas = pg.GraphicsLayoutWidget()
        self.canvas.setBackground(P.PANEL)
        self.canvas.ci.setSpacing(6)
        self.panels: dict[str, _TierPanel] = {}
        self._layout_key: tuple = ()
        self.by_owner = QCheckBox("colour by owner")
        self.by_owner.toggled.connect(self.refresh)
        self.legend = QLabel()
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        self.legend.setWordWrap(True)
        self.info = QLabel("hover a block")
        self.info.setStyleSheet(f"color: {P.TEXT_DIM}; font-family: monospace;")
        self.info.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        top = QHBoxLayout()
        top.addWidget(self.legend, 1)
        top.addWidget(self.by_owner)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addLayout(top)
        lay.addWidget(self.canvas, 1)
        lay.addWidget(self.info)

        self.canvas.scene().sigMouseMoved.connect(self._on_mouse_moved)
        self.canvas.scene().sigMouseClicked.connect(self._on_mouse_clicked)
        model.state_changed.connect(self.refresh)
        model.selection_changed.connect(self.refresh)

    # ------------------------------------------------------------- drawing
    def refresh(self) -> None:
        st = self.model.state
        key = tuple((n, t.num_blocks, t.format, bool(t.formats))
                    for n, t in sorted(st.tiers.items()))
        if key != self._layout_key:
            self._rebuild(st)
            self._layout_key = key
        sel = self.model.selected_block
        counts: dict[str, np.ndarray] = {}
        for name, panel in self.panels.items():
            t = st.tiers[name]
            panel.configure(t.num_blocks, t.block_size, t.format)
            base = mark_demoted(st, name, st.block_codes(name))
            panel.base = base.copy()
            counts[name] = np.bincount(base, minlength=8)
            panel.draw(cell_codes(
                st, name, by_owner=self.by_owner.isChecked(),
                highlight=self.model.highlighted_blocks(name),
                selected=sel[1] if sel is not None and sel[0] == name else None, codes=base,
            ))
        self._update_legend_counts(counts)

    def _rebuild(self, st: KVState) -> None:
        self.canvas.ci.clear()
        self.panels = {}
        order = [t for t in S.TIERS if t in st.tiers] + sorted(set(st.tiers) - set(S.TIERS))
        for col, name in enumerate(order):
            self.panels[name] = _TierPanel(self.canvas.ci, col, name)
            # Device gets most of the width: it is the tier people watch.
            self.canvas.ci.layout.setColumnStretchFactor(col, 3 if name == "gpu" else 1)
        self._build_legend(st)

    def _build_legend(self, st: KVState) -> None:
        """Legend entries (colour, label, tier, code), one per distinct colour+label."""
        self._legend_entries: list[tuple[str, str, str, int]] = []
        seen: set[tuple[str, str]] = set()
        for name, t in st.tiers.items():
            colours, labels = P.state_colours(name, t.format), P.state_labels(name, t.format)
            demoted = (P.CODE_DEMOTED_USED, P.CODE_DEMOTED_SHARED) if t.formats else ()
            for code in (S.BLOCK_FREE, S.BLOCK_CACHED, S.BLOCK_USED, S.BLOCK_SHARED, *demoted):
                if (colours[code], labels[code]) not in seen:
                    seen.add((colours[code], labels[code]))
                    self._legend_entries.append((colours[code], labels[code], name, code))

    def _update_legend_counts(self, counts: dict[str, np.ndarray]) -> None:
        parts = []
        for colour, label, name, code in getattr(self, "_legend_entries", []):
            n = int(counts[name][code]) if name in counts else 0
            parts.append(f"<span style='color:{colour}; font-size:12pt'>■</span>&nbsp;{label}"
                         f"&nbsp;<span style='color:{P.TEXT_DIM}'>{n:,}</span>")
        self.legend.setText(" &nbsp; ".join(parts))

    def cells(self, tier: str) -> np.ndarray:
        """The tier's drawn codes, flattened to one per block (for tests and export)."""
        p = self.panels[tier]
        return p.cells.reshape(-1)[: p.num_blocks].copy()

    # ------------------------------------------------------------- picking
    def pick(self, scene_pos: QPointF) -> tuple[str, int] | None:
        """(tier, block) under a scene position, or None."""
        for name, p in self.panels.items():
            if p.view.sceneBoundingRect().contains(scene_pos):
                v = p.view.mapSceneToView(scene_pos)
                b = p.block_at(v.x(), v.y())
                return None if b is None else (name, b)
        return None

    def scene_pos_of(self, tier: str, block: int) -> QPointF:
        """Scene position of a block's cell centre (the inverse of ``pick``)."""
        p = self.panels[tier]
        row, col = divmod(block, p.width)
        return p.view.mapViewToScene(QPointF(col + 0.5, row + 0.5))

    def _on_mouse_moved(self, scene_pos: QPointF) -> None:
        hit = self.pick(scene_pos)
        if hit is None:
            self.info.setText("hover a block")
            self.hovered.emit("")
            return
        tier, block = hit
        code = int(self.panels[tier].base[block])
        text = format_block(describe_block(self.model.state, tier, block, code))
        self.info.setText(text.replace("\n", "  ·  "))
        QToolTip.showText(QCursor.pos(), text, self)
        self.hovered.emit(text)

    def _on_mouse_clicked(self, ev: Any) -> None:
        if ev.button() != Qt.MouseButton.LeftButton:
            return
        hit = self.pick(ev.scenePos())
        if hit is None:
            self.model.select_block(None)
        else:
            self.model.select_seq(None)
            self.model.select_block(*hit)
