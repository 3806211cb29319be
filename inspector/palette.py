"""The inspector's colours: one dark palette for widgets, plots and the block map.

Block-map lookup table (uint8 code -> RGBA). Codes 0..3 are ``schema.BLOCK_*`` (free,
cached, used, shared); the map adds its own codes on top, so one small LUT (< 256
entries, Qt's Indexed8 fast path) draws every mode:

    0..3    block state (as KVState.block_codes gives it)
    4       padding cell (grid is wider than the tier)
    5       the selected block
    6, 7    used / shared blocks demoted to a quantized format (per-block ``quantize``)
    8..15   codes 0..7 dimmed (a selection is active and the block is not in it)
    16..39  owner colours (colour-by-owner mode), 40..63 the same dimmed
"""

from __future__ import annotations

import zlib

import numpy as np

from kvscope.engine.events import schema as S

# Widget / plot palette.
BG = "#12141a"
PANEL = "#1a1d25"
PANEL_2 = "#222632"
GRID = "#2c3140"
TEXT = "#d6dbe5"
TEXT_DIM = "#8a93a6"
ACCENT = "#5aa9e6"
WARN = "#e5a04b"
ERROR = "#e0625c"
OK = "#5fbf7f"

# Block states, device tier.
FREE = "#303644"
CACHED = "#3f79a8"  # evictable, revivable by a prefix hit
USED = "#4fb07a"
SHARED = "#e3a23f"
QUANT_USED = "#37b5ad"  # used/shared blocks of a quantized-format tier
QUANT_SHARED = "#c4d05a"
# Host tier: an in-use host block belongs to a swapped-out sequence; a cached one was offloaded.
SWAPPED = "#b27ccc"
OFFLOADED = "#6d5f9c"
PAD = PANEL  # invisible: the view background
SELECTED = "#ffffff"

# Series colours for the timelines.
SERIES = {
    "used": USED, "cached": CACHED, "free": "#3a4152", "hit": ACCENT, "running": USED,
    "waiting": WARN, "swapped": SWAPPED, "throughput": "#d9d27a", "preempt": ERROR,
    "evict": "#e07f3c", "demote": QUANT_USED,
    "prefetch": "#6fb7ff", "arrived": "#7fd67f", "missed": ERROR,
}

# Distinct, not-too-saturated owner colours (colour-by-owner mode).
OWNER_COLOURS = (
    "#e6194b", "#3cb44b", "#ffe119", "#4363d8", "#f58231", "#911eb4", "#46f0f0", "#f032e6",
    "#bcf60c", "#fabebe", "#008080", "#e6beff", "#9a6324", "#fffac8", "#aaffc3", "#808000",
    "#ffd8b1", "#6f8fff", "#ff7f7f", "#7fffd4", "#d2a0ff", "#ffb347", "#77dd77", "#cfcfc4",
)

CODE_PAD = 4
CODE_SELECTED = 5
CODE_DEMOTED_USED = 6
CODE_DEMOTED_SHARED = 7
DIM_OFFSET = 8
OWNER_BASE = 16
OWNER_DIM_BASE = OWNER_BASE + len(OWNER_COLOURS)
# Colour modes beyond state/owner (one 256-entry LUT serves every mode: Qt's Indexed8
# fast path takes up to 256 colours, so switching modes never swaps the table).
RAMP_LEN = 16  # a sequential ramp: ref count 1..15+, or age buckets (log2 steps)
RAMP_BASE = 64
RAMP_DIM_BASE = RAMP_BASE + RAMP_LEN
FORMAT_LEN = 16  # one colour per per-block format code (0 = the tier's own format)
FORMAT_BASE = 96
FORMAT_DIM_BASE = FORMAT_BASE + FORMAT_LEN
LUT_SIZE = 256
# viridis-like, dark (low) to bright (high)
RAMP_COLOURS = (
    "#440154", "#481a6c", "#472f7d", "#414487", "#39568c", "#31688e", "#2a788e", "#23888e",
    "#1f988b", "#22a884", "#35b779", "#54c568", "#7ad151", "#a5db36", "#d2e21b", "#fde725",
)
FORMAT_COLOURS = (
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
    "#9c755f", "#bab0ac", "#86bcb6", "#d37295", "#fabfd2", "#b6992d", "#499894", "#79706e",
)

QUANTIZED_FORMATS = S.QUANTIZED_KV_FORMATS


def rgba(hex_colour: str, alpha: int = 255) -> tuple[int, int, int, int]:
    h = hex_colour.lstrip("#")
    return int(h[0:2], 16), int(h[2:4], 16), int(h[4:6], 16), alpha


def _dim(c: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    bg = rgba(BG)
    return tuple(int(bg[i] + (c[i] - bg[i]) * 0.4) for i in range(3)) + (255,)


def state_colours(tier: str, fmt: str) -> dict[int, str]:
    """Colour of each block state in this tier: host blocks read as swapped/offloaded,
    a quantized tier's live blocks get the quantized hues. A cache group's pool ("cpu/1")
    reads as its tier."""
    if tier.partition("/")[0] == "cpu":
        return {S.BLOCK_FREE: FREE, S.BLOCK_CACHED: OFFLOADED, S.BLOCK_USED: SWAPPED,
                S.BLOCK_SHARED: SHARED}
    quant = fmt in QUANTIZED_FORMATS
    return {S.BLOCK_FREE: FREE, S.BLOCK_CACHED: CACHED,
            S.BLOCK_USED: QUANT_USED if quant else USED,
            S.BLOCK_SHARED: QUANT_SHARED if quant else SHARED,
            CODE_DEMOTED_USED: QUANT_USED, CODE_DEMOTED_SHARED: QUANT_SHARED}


def state_labels(tier: str, fmt: str) -> dict[int, str]:
    if tier.partition("/")[0] == "cpu":
        return {S.BLOCK_FREE: "free", S.BLOCK_CACHED: "offloaded",
                S.BLOCK_USED: "swapped out", S.BLOCK_SHARED: "swapped, shared"}
    q = f" ({fmt})" if fmt in QUANTIZED_FORMATS else ""
    return {S.BLOCK_FREE: "free", S.BLOCK_CACHED: "cached (evictable)",
            S.BLOCK_USED: f"in use{q}", S.BLOCK_SHARED: f"shared{q}",
            CODE_DEMOTED_USED: "in use (demoted)", CODE_DEMOTED_SHARED: "shared (demoted)"}


def block_lut(tier: str, fmt: str) -> np.ndarray:
    """uint8 RGBA lookup table [LUT_SIZE, 4] for one tier's map (see module docstring)."""
    lut = np.zeros((LUT_SIZE, 4), dtype=np.uint8)
    for code, colour in state_colours(tier, fmt).items():
        lut[code] = rgba(colour)
        lut[code + DIM_OFFSET] = _dim(rgba(colour))
    lut[CODE_PAD] = rgba(PAD)
    lut[CODE_PAD + DIM_OFFSET] = rgba(PAD)
    lut[CODE_SELECTED] = rgba(SELECTED)
    lut[CODE_SELECTED + DIM_OFFSET] = rgba(SELECTED)
    for i, colour in enumerate(OWNER_COLOURS):
        lut[OWNER_BASE + i] = rgba(colour)
        lut[OWNER_DIM_BASE + i] = _dim(rgba(colour))
    for base, dim, colours in ((RAMP_BASE, RAMP_DIM_BASE, RAMP_COLOURS),
                               (FORMAT_BASE, FORMAT_DIM_BASE, FORMAT_COLOURS)):
        for i, colour in enumerate(colours):
            lut[base + i] = rgba(colour)
            lut[dim + i] = _dim(rgba(colour))
    return lut


def owner_index(seq_id: str) -> int:
    """Stable colour slot of a sequence (same colour across runs and seeks)."""
    return zlib.crc32(seq_id.encode()) % len(OWNER_COLOURS)


def owner_colour(seq_id: str) -> str:
    return OWNER_COLOURS[owner_index(seq_id)]


STYLESHEET = f"""
QWidget {{ background: {BG}; color: {TEXT}; font-size: 10pt; }}
QMainWindow::separator {{ background: {GRID}; width: 3px; height: 3px; }}
QDockWidget {{ titlebar-close-icon: none; }}
QDockWidget::title {{ background: {PANEL_2}; padding: 4px 8px; color: {TEXT_DIM};
    font-weight: bold; }}
QGroupBox {{ border: 1px solid {GRID}; border-radius: 4px; margin-top: 14px; }}
QGroupBox::title {{ subcontrol-origin: margin; left: 8px; color: {TEXT_DIM}; }}
QTableView, QListWidget, QTreeView {{ background: {PANEL}; alternate-background-color: {PANEL_2};
    gridline-color: {GRID}; selection-background-color: #2f5d86; selection-color: white;
    border: 1px solid {GRID}; }}
QHeaderView::section {{ background: {PANEL_2}; color: {TEXT_DIM}; border: none;
    border-right: 1px solid {GRID}; padding: 3px 6px; }}
QLineEdit, QComboBox, QDoubleSpinBox, QSpinBox {{ background: {PANEL}; border: 1px solid {GRID};
    border-radius: 3px; padding: 2px 6px; selection-background-color: #2f5d86; }}
QPushButton, QToolButton {{ background: {PANEL_2}; border: 1px solid {GRID}; border-radius: 3px;
    padding: 3px 10px; }}
QPushButton:hover, QToolButton:hover {{ border-color: {ACCENT}; }}
QPushButton:checked, QToolButton:checked {{ background: #2f5d86; border-color: {ACCENT}; }}
QSlider::groove:horizontal {{ height: 4px; background: {GRID}; border-radius: 2px; }}
QSlider::sub-page:horizontal {{ background: {ACCENT}; border-radius: 2px; }}
QSlider::handle:horizontal {{ background: {TEXT}; width: 12px; margin: -5px 0;
    border-radius: 6px; }}
QStatusBar {{ background: {PANEL_2}; color: {TEXT_DIM}; }}
QStatusBar QLabel {{ background: transparent; padding: 0 8px; }}
QTabWidget::pane {{ border: 1px solid {GRID}; }}
QTabBar::tab {{ background: {PANEL}; color: {TEXT_DIM}; padding: 4px 12px;
    border: 1px solid {GRID}; }}
QTabBar::tab:selected {{ background: {PANEL_2}; color: {TEXT}; }}
QMenuBar, QMenu {{ background: {PANEL_2}; }}
QMenu::item:selected, QMenuBar::item:selected {{ background: #2f5d86; }}
QToolTip {{ background: {PANEL_2}; color: {TEXT}; border: 1px solid {ACCENT}; padding: 4px; }}
QLabel#banner {{ background: #4a1f22; color: #ffd9d6; border: 1px solid {ERROR};
    padding: 6px 10px; font-weight: bold; }}
QScrollBar:vertical {{ background: {PANEL}; width: 10px; }}
QScrollBar::handle:vertical {{ background: {GRID}; border-radius: 4px; min-height: 20px; }}
"""
