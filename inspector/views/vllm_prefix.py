"""What a vLLM-format KV-event stream carries, drawn: per medium, the held block hashes
as a map (one cell per hash, in prefix-chain order, coloured by age; grey: orphaned, its
chain to a first block is broken so no request can hit it), a table with each hash's
prefix position, tokens and age, and the store/remove timeline. A banner says what vLLM's
stream does not publish (allocation, block tables, preemption...).

The helpers at the top are Qt-free (tested without a display)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvscope.engine.events.vllm.prefix_cache import NOT_PUBLISHED, VllmPrefixCache

MAX_ROWS = 500  # table rows per medium: the newest hashes
MAP_COLUMNS = 64
AGE_LEVELS = 200  # colour levels of the age map (uint8 image; 255 = orphan, 254 = pad)


def _hex(h: Any) -> str:
    if isinstance(h, bytes):
        return h.hex()[:16]
    return f"{h & (2 ** 64 - 1):016x}" if isinstance(h, int) else str(h)


def block_rows(cache: VllmPrefixCache, medium: str, now: float,
               limit: int = MAX_ROWS) -> list[tuple[str, int, int, float, str]]:
    """(hash, prefix position in blocks (0: orphan), tokens, age s, parent) per held
    hash, newest first, at most ``limit``."""
    blocks = cache.media.get(medium, {})
    depth = cache.prefix_depths(medium)
    newest = sorted(blocks.items(), key=lambda kv: kv[1].stored_ts, reverse=True)[:limit]
    return [(_hex(h), depth.get(h, 0), b.num_tokens, max(0.0, now - b.stored_ts),
             "-" if b.parent is None else _hex(b.parent)) for h, b in newest]


def chain_order(cache: VllmPrefixCache, medium: str) -> list[Any]:
    """Held hashes in depth-first prefix order (roots by store time), orphans last."""
    blocks = cache.media.get(medium, {})
    children: dict[Any, list[Any]] = {}
    roots, orphans = [], []
    for h, b in blocks.items():
        if b.parent is None:
            roots.append(h)
        elif b.parent in blocks:
            children.setdefault(b.parent, []).append(h)
        else:
            orphans.append(h)
    out: list[Any] = []
    stack = sorted(roots, key=lambda h: blocks[h].stored_ts, reverse=True)
    while stack:
        h = stack.pop()
        out.append(h)
        stack.extend(sorted(children.get(h, ()), key=lambda c: blocks[c].stored_ts,
                            reverse=True))
    seen = set(out)
    return out + sorted((h for h in orphans + list(blocks) if h not in seen),
                        key=lambda h: blocks[h].stored_ts)


def age_map(cache: VllmPrefixCache, medium: str, now: float,
            columns: int = MAP_COLUMNS) -> np.ndarray:
    """uint8 [rows, columns]: age level 0 (new) .. AGE_LEVELS-1 (oldest held), 255 orphan,
    254 padding."""
    order = chain_order(cache, medium)
    blocks = cache.media.get(medium, {})
    depth = cache.prefix_depths(medium)
    rows = max(1, -(-len(order) // columns))
    img = np.full(rows * columns, 254, dtype=np.uint8)
    if order:
        ages = np.array([now - blocks[h].stored_ts for h in order], dtype=np.float64)
        span = max(ages.max(), 1e-9)
        img[:len(order)] = np.clip(ages / span * (AGE_LEVELS - 1), 0, AGE_LEVELS - 1)
        orphan = np.array([depth.get(h, 0) == 0 for h in order])
        img[:len(order)][orphan] = 255
    return img.reshape(rows, columns)


def timeline_arrays(cache: VllmPrefixCache) -> dict[str, np.ndarray]:
    """Seconds since the first batch, hashes stored/removed per batch, held per medium."""
    tl = cache.timeline
    t0 = tl[0].ts if tl else 0.0
    media = sorted({m for p in tl for m in p.held})
    out = {"t": np.array([p.ts - t0 for p in tl]),
           "stored": np.array([p.stored for p in tl]),
           "removed": np.array([p.removed for p in tl])}
    for m in media:
        out[f"held:{m}"] = np.array([p.held.get(m, 0) for p in tl])
    return out


def media_order(cache: VllmPrefixCache) -> list[str]:
    """GPU first, then CPU, STORAGE and any other medium by name."""
    rank = {"GPU": 0, "CPU": 1, "STORAGE": 2}
    return sorted(cache.media, key=lambda m: (rank.get(m, 3), m))


def summary_text(cache: VllmPrefixCache) -> str:
    parts = []
    for m in media_order(cache):
        s = cache.summary(m)
        parts.append(f"{m}: {s['blocks']} hashes, {s['prefixes']} hit-able prefixes "
                     f"(longest {s['longest_prefix_blocks']} blocks), {s['orphans']} orphaned, "
                     f"age median {s['age_median_s']:.1f} s / max {s['age_max_s']:.1f} s")
    bs = f"block size {cache.block_size}" if cache.block_size else "block size unknown"
    extra = (f"; {cache.unknown_removed} removals of unknown hashes (joined late?)"
             if cache.unknown_removed else "")
    return (f"{cache.batches} batches, {bs}, {cache.clears} clears{extra}\n"
            + ("\n".join(parts) or "no blocks yet"))


# ------------------------------------------------------------------------ Qt side
def make_view(cache_getter: Any) -> Any:
    """The widget; ``cache_getter()`` returns the VllmPrefixCache to draw."""
    import pyqtgraph as pg
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import (
        QLabel,
        QSplitter,
        QTableWidget,
        QTableWidgetItem,
        QTabWidget,
        QVBoxLayout,
        QWidget,
    )

    from kvscope.inspector import palette as P

    lut = np.zeros((256, 4), dtype=np.uint8)
    young, old = np.array(P.rgba(P.OK)), np.array(P.rgba(P.CACHED))
    for i in range(AGE_LEVELS):
        f = i / (AGE_LEVELS - 1)
        lut[i] = (young * (1 - f) + old * f).astype(np.uint8)
    lut[254] = P.rgba(P.BG)
    lut[255] = P.rgba(P.TEXT_DIM)

    class VllmPrefixView(QWidget):
        def __init__(self) -> None:
            super().__init__()
            self.setWindowTitle("kvscope inspector: vLLM KV events")
            lay = QVBoxLayout(self)
            note = QLabel("What this stream cannot show: " + NOT_PUBLISHED)
            note.setWordWrap(True)
            note.setStyleSheet(f"color: {P.WARN}; padding: 4px;")
            lay.addWidget(note)
            self.status = QLabel("waiting for events ...")
            self.status.setStyleSheet(f"color: {P.TEXT};")
            lay.addWidget(self.status)
            self.summary = QLabel("")
            self.summary.setStyleSheet(f"color: {P.TEXT_DIM}; font-family: monospace;")
            lay.addWidget(self.summary)
            split = QSplitter(Qt.Orientation.Vertical)
            lay.addWidget(split, 1)
            self.plot = pg.PlotWidget(title="held hashes per medium; stored / removed per batch")
            self.plot.setLabel("bottom", "seconds since the first batch")
            self.plot.addLegend()
            split.addWidget(self.plot)
            self.tabs = QTabWidget()
            split.addWidget(self.tabs)
            self._media: dict[str, tuple[Any, Any]] = {}
            self._curves: dict[str, Any] = {}

        def _medium_tab(self, m: str) -> tuple[Any, Any]:
            if m not in self._media:
                w = QSplitter(Qt.Orientation.Horizontal)
                glw = pg.GraphicsLayoutWidget()
                vb = glw.addViewBox(lockAspect=True, invertY=True)
                img = pg.ImageItem(autoDownsample=False, axisOrder="row-major")
                img.setLookupTable(lut)
                vb.addItem(img)
                table = QTableWidget(0, 5)
                table.setHorizontalHeaderLabels(["hash", "prefix pos", "tokens", "age s",
                                                 "parent"])
                w.addWidget(glw)
                w.addWidget(table)
                self.tabs.addTab(w, f"{m} block-hash map")
                self._media[m] = (img, table)
            return self._media[m]

        def refresh(self, status: str = "") -> None:
            cache = cache_getter()
            if status:
                self.status.setText(status)
            self.summary.setText(summary_text(cache))
            now = cache.last_ts
            arrays = timeline_arrays(cache)
            colours = [P.ACCENT, P.WARN, P.OK]
            for i, key in enumerate(k for k in arrays if k.startswith("held:")):
                if key not in self._curves:
                    self._curves[key] = self.plot.plot(
                        name=key[5:], pen=pg.mkPen(colours[i % 3], width=2))
                self._curves[key].setData(arrays["t"], arrays[key])
            for key, colour in (("stored", P.OK), ("removed", P.ERROR)):
                name = f"{key} / batch"
                if name not in self._curves:
                    self._curves[name] = self.plot.plot(
                        name=name, pen=None, symbol="o", symbolSize=4,
                        symbolBrush=colour)
                self._curves[name].setData(arrays["t"], arrays[key])
            for m in media_order(cache):
                img, table = self._medium_tab(m)
                img.setImage(age_map(cache, m, now), levels=(0, 255), autoLevels=False)
                rows = block_rows(cache, m, now)
                table.setRowCount(len(rows))
                for r, row in enumerate(rows):
                    for c, v in enumerate(row):
                        table.setItem(r, c, QTableWidgetItem(
                            f"{v:.1f}" if isinstance(v, float) else str(v)))

    return VllmPrefixView()
