"""Physical block map: one cell per physical block, one panel per tier.

Each tier is a uint8 ``ImageItem`` over a small LUT (``inspector.palette``): Qt's Indexed8
fast path, smooth at 1M blocks. Invariants: both image sides stay <= 32767 and
autoDownsample stays off (downsampling would AVERAGE category codes into nonsense), and
the cell of block ``b`` is ``(row, col) = divmod(b, width)``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, Qt, Signal
from PySide6.QtGui import QCursor
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QToolTip,
    QVBoxLayout,
    QWidget,
)

from kvscope.engine.events import KVState
from kvscope.engine.events import schema as S
from kvscope.inspector import palette as P
from kvscope.inspector.model import InspectorModel
from kvscope.inspector.views.cell_grid import GRID_MAX_BLOCKS, CellGrid
from kvscope.inspector.views.legend import Legend

MAX_SIDE = 32767


def grid_width(num_blocks: int, aspect: float = 1.6) -> int:
    """Columns of a tier's grid: roughly ``aspect`` times wider than tall, <= MAX_SIDE."""
    if num_blocks <= 0:
        return 1
    w = math.ceil(math.sqrt(num_blocks * aspect))
    w = max(w, math.ceil(num_blocks / MAX_SIDE))
    return min(w, MAX_SIDE)


# code -> its dimmed code (a selection is active and the cell is not in it), as one
# table lookup over the whole map instead of boolean masks.
_DIM = np.arange(256, dtype=np.uint8)
_DIM[: P.DIM_OFFSET] += P.DIM_OFFSET
_DIM[P.OWNER_BASE: P.OWNER_DIM_BASE] += P.OWNER_DIM_BASE - P.OWNER_BASE
_DIM[P.RAMP_BASE: P.RAMP_DIM_BASE] += P.RAMP_LEN
_DIM[P.FORMAT_BASE: P.FORMAT_DIM_BASE] += P.FORMAT_LEN
_NO_BLOCKS = np.zeros(0, dtype=np.int64)

# Colour modes: what a cell's colour says about its block.
MODES = ("state", "owner", "ref count", "format", "age")
# ref count -> code: 0 stays a state code (free/cached), 1..15+ walk the ramp
_REF_CODES = np.array([S.BLOCK_FREE] + [P.RAMP_BASE + i for i in range(P.RAMP_LEN - 1)],
                      dtype=np.uint8)
_OWNER_SLOTS = len(P.OWNER_COLOURS)
# age (steps, capped) -> code: log2 buckets on the ramp, newest brightest
_AGE_MAX = (1 << (P.RAMP_LEN - 1)) - 1
_AGE_CODES = ((P.RAMP_BASE + P.RAMP_LEN - 1) - np.minimum(
    np.floor(np.log2(np.arange(_AGE_MAX + 1) + 1.0)), P.RAMP_LEN - 1)).astype(np.uint8)


def state_codes(state: KVState, tier: str, idx: np.ndarray | None = None) -> np.ndarray:
    """``KVState.block_codes`` with demoted blocks marked: used/shared blocks whose own
    format differs from the tier's (``quantize``) read as ``P.CODE_DEMOTED_USED`` /
    ``P.CODE_DEMOTED_SHARED`` (the state mode's codes; legend counts take 8 bins)."""
    codes = state.block_codes(tier, idx)
    t = state.tiers[tier]
    if len(t.format_names) > 1:  # some block of this tier was quantized once
        fmt = t.block_format_codes() if idx is None else t.block_format_codes()[idx]
        demoted = fmt != 0
        codes[demoted & (codes == S.BLOCK_USED)] = P.CODE_DEMOTED_USED
        codes[demoted & (codes == S.BLOCK_SHARED)] = P.CODE_DEMOTED_SHARED
    return codes


def mode_codes(state: KVState, tier: str, mode: str,
               idx: np.ndarray | None = None) -> np.ndarray:
    """uint8 LUT codes, one per block of ``tier`` (or per block of ``idx``), for a colour
    mode (all numpy):

    state      free / cached / in use / shared (``KVState.block_codes``)
    owner      in-use blocks by the sequence that took them (palette slot of its id),
               the rest by state (shared blocks read as shared)
    ref count  free/cached by state, held blocks on a ramp from ref 1 to ref 15+
    format     free blocks by state, the rest by per-block page format (0 = the tier's)
    age        steps since the block last changed, log2 buckets on the ramp (bright =
               just now; never changed = darkest)
    """
    t = state.tiers[tier]

    def col(a: np.ndarray) -> np.ndarray:
        return a if idx is None else a[idx]

    if mode == "state":
        return state_codes(state, tier, idx)
    if mode == "owner":
        if idx is None or (t.owner[idx] == state.ORPHAN).any():  # the blocks asked for
            state.resolve_owners(tier)  # (a full pass over 4M owners costs ~5 ms)
        codes = state.block_codes(tier, idx)
        own = col(t.owner)
        slots = (own % _OWNER_SLOTS).astype(np.uint8)
        slots += P.OWNER_BASE
        return np.where((codes == S.BLOCK_USED) & (own >= 0), slots, codes)
    if mode == "ref count":
        ref = np.minimum(col(t.ref), P.RAMP_LEN - 1).astype(np.uint8)
        codes = _REF_CODES[ref]
        codes |= col(t.hashed_c.np) & (ref == 0)  # ref 0 + hash: cached
        return codes
    if mode == "format":
        codes = col(t.block_format_codes()).astype(np.uint8) % P.FORMAT_LEN
        codes += P.FORMAT_BASE
        unheld = (col(t.ref) == 0) & (col(t.hashed_c.np) == 0)
        codes[unheld] = S.BLOCK_FREE
        return codes
    if mode == "age":
        # integer ops and one table lookup (no float log2 over millions of blocks)
        age = np.subtract(max(state.step, 0), col(t.touched))  # int32 (NEVER: ~2**30)
        np.clip(age, 0, _AGE_MAX, out=age)
        return _AGE_CODES[age]
    raise ValueError(f"unknown colour mode {mode!r}; known: {', '.join(MODES)}")


TIER_NAMES = {"gpu": "GPU (device)", "cpu": "CPU (host)", "disk": "Disk (local)",
              # the hybrid cache's group 1 (engine.cache.window_group)
              "gpu/1": "GPU window group (sliding-window layers)",
              "cpu/1": "CPU window group (swapped)"}


class AgeIndex:
    """A tier's blocks by the step of their last change, so that an age-mode frame
    recomputes only blocks whose log2 age bucket moves at this step (age + 1 reaches a
    power of two: last change at ``step + 1 - 2**k``) plus the blocks that changed."""

    MAX_STEPS = 64  # a frame further ahead than this recomputes the whole tier

    def __init__(self, touched: np.ndarray) -> None:
        order = np.argsort(touched, kind="stable")
        steps, starts = np.unique(touched[order], return_index=True)
        ends = np.append(starts[1:], len(order))
        self.by_step = {int(s): order[a:b] for s, a, b in zip(
            steps.tolist(), starts.tolist(), ends.tolist(), strict=True)}

    def add(self, blocks: np.ndarray, touched: np.ndarray) -> None:
        """``blocks`` changed; ``touched`` is the tier's last-change column."""
        steps = touched[blocks]
        for s in np.unique(steps).tolist():
            new = blocks[steps == s]
            old = self.by_step.get(s)
            self.by_step[s] = new if old is None else np.concatenate([old, new])

    def crossing(self, s0: int, s1: int, touched: np.ndarray) -> np.ndarray:
        """Blocks whose age bucket differs between steps ``s0`` and ``s1`` (> s0)."""
        out = []
        for s in range(s0 + 1, s1 + 1):
            for k in range(1, P.RAMP_LEN):
                t = s + 1 - (1 << k)
                blocks = self.by_step.get(t)
                if blocks is not None:
                    out.append(blocks[touched[blocks] == t])  # not changed since
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def cell_codes(state: KVState, tier: str, *, mode: str = "state",
               highlight: list[int] | None = None, selected: int | None = None,
               codes: np.ndarray | None = None) -> np.ndarray:
    """The 1-D LUT codes of ``tier``'s cells (length num_blocks), as the map draws them.

    ``mode``: one of ``MODES``.
    ``codes``: ``mode_codes(state, tier, mode)`` if the caller already has it (it is
    modified)."""
    codes = mode_codes(state, tier, mode) if codes is None else codes
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
        code = int(state_codes(state, tier, np.array([block]))[0])
    return {
        "tier": tier, "block": block, "state": P.state_labels(tier, t.format)[code],
        "ref": int(t.ref[block]), "filled": filled, "block_size": t.block_size,
        "hash": h, "format": t.format_names[t.block_format_codes()[block]],
        "owners": owners,
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

    FULL_REDRAW = 1 << 16  # an age frame moving more blocks than this redraws the tier

    def __init__(self, layout: pg.GraphicsLayout, col: int, tier: str, row: int = 0) -> None:
        self.tier = tier
        self.title = layout.addLabel("", row=row, col=col, color=P.TEXT, size="10pt")
        self.view: pg.ViewBox = layout.addViewBox(row=row + 1, col=col)
        self.view.setAspectLocked(True)
        self.view.invertY(True)
        self.view.setMenuEnabled(False)
        self.view.setBackgroundColor(P.PANEL)
        self.image = pg.ImageItem(axisOrder="row-major")
        self.image.setAutoDownsample(False)
        self.view.addItem(self.image)
        self.grid: CellGrid | None = None  # small pools only: borders and block ids
        self.width = 1
        self.num_blocks = -1
        self.fmt = ""
        self.cells = np.zeros((1, 1), dtype=np.uint8)  # drawn: codes with the selection
        self.base = np.zeros(0, dtype=np.uint8)  # KVState.block_codes of the frame drawn
        self.codes = np.zeros(0, dtype=np.uint8)  # mode_codes of the frame drawn (undimmed)
        self.counts = np.zeros(4, dtype=np.int64)  # blocks per state code, same frame
        self.draw_key: tuple | None = None  # the frame ``codes`` show (see update_codes)
        self.age: AgeIndex | None = None  # age mode: blocks by last-change step
        # the selection drawn: while one is active (``lit`` not None) every block outside
        # ``lit_ids`` is dimmed; ``selected`` is the selected block's cell
        self.lit: np.ndarray | None = None  # bool per block, True at lit_ids
        self.lit_ids = _NO_BLOCKS
        self.selected: int | None = None

    def configure(self, num_blocks: int, block_size: int, fmt: str) -> None:
        if (num_blocks, fmt) == (self.num_blocks, self.fmt):
            return
        self.num_blocks, self.fmt = num_blocks, fmt
        self.draw_key = None
        self.width = grid_width(num_blocks)
        rows = max(1, math.ceil(num_blocks / self.width))
        self.cells = np.full((rows, self.width), P.CODE_PAD, dtype=np.uint8)
        lut = P.block_lut(self.tier, fmt)
        self.image.setLookupTable(lut)
        if num_blocks <= GRID_MAX_BLOCKS:
            if self.grid is None:
                self.grid = CellGrid(self.image)
            self.grid.configure(num_blocks, self.width, np.asarray(lut))
            self.grid.codes = self.cells.reshape(-1)
        elif self.grid is not None:
            self.grid.setParentItem(None)
            self.grid = None
        name = TIER_NAMES.get(self.tier, self.tier)
        self.title.setText(f"<b>{name}</b> · {num_blocks:,} blocks × {block_size} tok · {fmt}")
        self.image.setImage(self.cells, autoLevels=False, levels=(0, P.LUT_SIZE),
                            autoDownsample=False)
        self.view.setRange(xRange=(0, self.width), yRange=(0, rows), padding=0.02)

    def update_codes(self, st: KVState, mode: str) -> np.ndarray | None:
        """Bring ``codes`` (and ``base``, ``counts``) to frame ``st`` in ``mode``; returns
        the blocks whose code may have changed, or None when the whole tier was redone.

        Incremental when ``st``'s tier is the object drawn last, brought up to date in
        place by ``KVState.clone(reuse=)`` (its ``changed_since`` names the blocks copied),
        in the same mode: then only those blocks (plus, in age mode, the blocks whose
        age bucket moves) are recomputed. A 4M-block tier that did not change costs
        nothing."""
        name = self.tier
        t = st.tiers[name]
        key = (id(t), t.version, mode, st.step if mode == "age" else None)
        prev, changed = self.draw_key, t.changed_since
        if key == prev:
            return _NO_BLOCKS
        self.draw_key = key
        same = prev is not None and prev[0] == key[0] and prev[2] == mode
        if same and prev[1] != t.version and (changed is None or changed[0] != prev[1]):
            same = False  # changed, but not by one in-place refresh from the frame drawn
        if same and mode == "age" and not (self.age is not None
                                           and 0 <= st.step - prev[3] <= AgeIndex.MAX_STEPS):
            same = False
        if not same:
            self.base = state_codes(st, name)
            self.counts = np.bincount(self.base, minlength=8)
            self.codes = self.base.copy() if mode == "state" else mode_codes(st, name, mode)
            self.age = AgeIndex(t.touched) if mode == "age" else None
            return None
        idx = _NO_BLOCKS
        if prev[1] != t.version:
            idx = np.unique(changed[1])
            new_base = state_codes(st, name, idx)
            self.counts += np.bincount(new_base, minlength=8) - np.bincount(
                self.base[idx], minlength=8)
            self.base[idx] = new_base
            if mode == "age":
                self.age.add(idx, t.touched)
        if mode == "age":
            idx = np.concatenate([idx, self.age.crossing(prev[3], st.step, t.touched)])
            if idx.size > max(self.FULL_REDRAW, self.num_blocks // 4):
                # many blocks of one step move bucket together: whole arrays are cheaper
                self.codes = mode_codes(st, name, mode)
                return None
        if idx.size:
            self.codes[idx] = self.base[idx] if mode == "state" else mode_codes(
                st, name, mode, idx)
        return idx

    def show(self, highlight: list[int] | None, selected: int | None,
             changed: np.ndarray | None) -> None:
        """Draw ``codes`` with the selection: ``highlight`` the blocks kept bright while
        the rest dims (None: nothing dims), ``selected`` the selected block's cell.
        ``changed``: the blocks whose code changed (``update_codes``; None: all). Only
        those and the blocks the selection's change touches are rewritten."""
        if selected is not None and not 0 <= selected < self.num_blocks:
            selected = None
        if changed is None or (highlight is None) != (self.lit is None):
            self._set_lit(highlight)
            self.selected = selected
            self.draw()
            return
        parts = [changed]
        if highlight is not None:
            ids = np.asarray(highlight, dtype=np.int64)
            if not np.array_equal(ids, self.lit_ids):
                parts += [self.lit_ids, ids]
                self._set_lit(ids)
        if selected != self.selected:
            parts.append(np.array([b for b in (self.selected, selected) if b is not None],
                                  dtype=np.int64))
            self.selected = selected
        blocks = np.concatenate(parts) if len(parts) > 1 else changed
        if blocks.size:
            self.draw_cells(np.unique(blocks) if len(parts) > 1 else blocks)

    def _set_lit(self, highlight: list[int] | np.ndarray | None) -> None:
        if highlight is None:
            self.lit, self.lit_ids = None, _NO_BLOCKS
            return
        if self.lit is None or self.lit.size != self.num_blocks:
            self.lit = np.zeros(self.num_blocks, dtype=bool)
        else:
            self.lit[self.lit_ids] = False
        self.lit_ids = np.asarray(highlight, dtype=np.int64)
        self.lit[self.lit_ids] = True

    def draw_cells(self, blocks: np.ndarray) -> None:
        """Redraw only ``blocks`` (the same cells ``draw`` would give them)."""
        c = self.codes[blocks]
        if self.lit is not None:
            c = np.where(self.lit[blocks], c, _DIM[c])
        if self.selected is not None:
            c[blocks == self.selected] = P.CODE_SELECTED
        self.cells.reshape(-1)[blocks] = c
        self._upload()

    def draw(self) -> None:
        """Redraw every cell from ``codes`` and the selection (no array allocated)."""
        flat = self.cells.reshape(-1)[: self.num_blocks]
        if self.lit is None:
            flat[:] = self.codes
        else:
            np.take(_DIM, self.codes, out=flat)
            flat[self.lit_ids] = self.codes[self.lit_ids]
        if self.selected is not None:
            flat[self.selected] = P.CODE_SELECTED
        self._upload()

    def _upload(self) -> None:
        self.image.setImage(self.cells, autoLevels=False, levels=(0, P.LUT_SIZE),
                            autoDownsample=False)
        if self.grid is not None:
            self.grid.update()

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
        self.colour_by = QComboBox()
        self.colour_by.addItems(MODES)
        self.colour_by.setToolTip("what a cell's colour shows")
        self.colour_by.currentTextChanged.connect(lambda _mode: self.refresh())
        self.legend = Legend()  # flows onto more lines when narrow, never over the map
        self.info = QLabel("hover a block")
        self.info.setStyleSheet(f"color: {P.TEXT_DIM}; font-family: monospace;")
        self.info.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        top = QHBoxLayout()
        top.addWidget(self.legend, 1)
        top.addWidget(QLabel("colour by"), 0, Qt.AlignmentFlag.AlignTop)
        top.addWidget(self.colour_by, 0, Qt.AlignmentFlag.AlignTop)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(4, 4, 4, 4)
        lay.addLayout(top)
        lay.addWidget(self.canvas, 1)
        lay.addWidget(self.info)

        self.canvas.scene().sigMouseMoved.connect(self._on_mouse_moved)
        self.canvas.scene().sigMouseClicked.connect(self._on_mouse_clicked)
        model.state_changed.connect(self.refresh)
        model.selection_changed.connect(self.refresh)

    @property
    def mode(self) -> str:
        return self.colour_by.currentText()

    def set_mode(self, mode: str) -> None:
        """Colour cells by ``mode`` (one of ``MODES``)."""
        if mode not in MODES:
            raise ValueError(f"unknown colour mode {mode!r}; known: {', '.join(MODES)}")
        self.colour_by.setCurrentText(mode)

    # ------------------------------------------------------------- drawing
    def refresh(self) -> None:
        """Redraw what changed: per tier, the blocks the frame changed (``update_codes``)
        and the cells the selection's change touches (``show``). An unchanged 4M-block
        host tier costs nothing per frame, a selection held while events stream costs
        the blocks that changed, and the result always equals ``cell_codes`` of the
        frame (tests/inspector/test_block_map_modes.py)."""
        st = self.model.state
        key = tuple((n, t.num_blocks, t.format, len(t.format_names) > 1)
                    for n, t in sorted(st.tiers.items()))
        if key != self._layout_key:
            self._rebuild(st)
            self._layout_key = key
        sel, mode = self.model.selected_block, self.mode
        counts: dict[str, np.ndarray] = {}
        for name, panel in self.panels.items():
            t = st.tiers[name]
            panel.configure(t.num_blocks, t.block_size, t.format)
            changed = panel.update_codes(st, mode)
            panel.show(self.model.highlighted_blocks(name),
                       sel[1] if sel is not None and sel[0] == name else None, changed)
            counts[name] = panel.counts
        self._update_legend_counts(counts)

    def _rebuild(self, st: KVState) -> None:
        self.canvas.ci.clear()
        self.panels = {}
        # one column per tier; a hybrid cache's window group ("gpu/1") sits under its
        # tier's map, so four maps never run off a window's right edge
        tiers = [t for t in S.TIERS if t in st.tiers]
        tiers += sorted({name.split("/")[0] for name in st.tiers} - set(tiers))
        for name in sorted(st.tiers, key=lambda n: (tiers.index(n.split("/")[0]), n)):
            tier, _, group = name.partition("/")
            col = tiers.index(tier)
            self.panels[name] = _TierPanel(self.canvas.ci, col, name, row=2 * int(group or 0))
            # Device gets most of the width: it is the tier people watch.
            self.canvas.ci.layout.setColumnStretchFactor(col, 3 if tier == "gpu" else 1)
        self._build_legend(st)

    def _build_legend(self, st: KVState) -> None:
        """Legend entries, one per distinct colour+label: (colour, label, the (tier, code)
        pairs it counts). It counts the first tier drawn in it (free: the gpu's) and that
        tier's window group ("gpu/1"), not other tiers that share the colour."""
        self._legend_entries: list[tuple[str, str, list[tuple[str, int]]]] = []
        index: dict[tuple[str, str], list[tuple[str, int]]] = {}
        for name, t in st.tiers.items():
            colours, labels = P.state_colours(name, t.format), P.state_labels(name, t.format)
            demoted = ((P.CODE_DEMOTED_USED, P.CODE_DEMOTED_SHARED)
                       if len(t.format_names) > 1 else ())
            for code in (S.BLOCK_FREE, S.BLOCK_CACHED, S.BLOCK_USED, S.BLOCK_SHARED, *demoted):
                key = (colours[code], labels[code])
                if key not in index:
                    index[key] = []
                    self._legend_entries.append((*key, index[key]))
                drawn = index[key]
                if not drawn or drawn[0][0].split("/")[0] == name.split("/")[0]:
                    drawn.append((name, code))

    def _update_legend_counts(self, counts: dict[str, np.ndarray]) -> None:
        entries = []
        for colour, label, drawn in getattr(self, "_legend_entries", []):
            n = sum(int(counts[name][code]) for name, code in drawn if name in counts)
            entries.append((colour, "■", label, f"{n:,}"))
        self.legend.set_entries(entries)

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
