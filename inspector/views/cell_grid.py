"""Cell borders and block ids over a small pool's block map.

A child of the tier's ``ImageItem`` (so its coordinates are cells: block ``b`` sits at
``(col, row) = (b % width, b // width)``). It draws only what is legible at the current
zoom: borders once a cell is ``BORDER_MIN_PX`` pixels wide, ids once the id fits in the
cell. Pools above ``GRID_MAX_BLOCKS`` never get one, so large maps keep the image-only
fast path (issue 14's 1M-block frame rate).
"""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QFont, QFontMetrics, QPainter, QPen
from PySide6.QtWidgets import QGraphicsObject

from kvscope.inspector import palette as P

GRID_MAX_BLOCKS = 4096  # above this the map is an image only
BORDER_MIN_PX = 5.0  # cell width (screen px) from which borders are drawn
LABEL_MIN_FONT_PX = 7  # smallest id font drawn


class CellGrid(QGraphicsObject):
    """Borders and ids for ``num_blocks`` cells laid out ``width`` per row; ``codes``
    (the drawn LUT codes, one per cell of the padded grid) pick a legible text colour."""

    def __init__(self, parent=None) -> None:  # noqa: ANN001
        super().__init__(parent)
        self.width = 1
        self.num_blocks = 0
        self.codes: np.ndarray | None = None
        self._dark_text = np.zeros(256, dtype=bool)
        self._border = QColor(P.PANEL)
        self.setFlag(QGraphicsObject.GraphicsItemFlag.ItemUsesExtendedStyleOption, True)

    def configure(self, num_blocks: int, width: int, lut: np.ndarray) -> None:
        self.prepareGeometryChange()
        self.num_blocks, self.width = num_blocks, width
        # per LUT code: dark text on light cells, light text on dark ones
        lum = lut[:, :3].astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32)
        self._dark_text = lum > 140

    def boundingRect(self) -> QRectF:  # noqa: N802 - Qt's name
        rows = -(-self.num_blocks // max(1, self.width))
        return QRectF(0, 0, self.width, rows)

    def paint(self, painter: QPainter, option, widget=None) -> None:  # noqa: ANN001
        if not self.num_blocks:
            return
        tr = painter.worldTransform()
        px = abs(tr.m11()) or abs(tr.m12())  # screen pixels per cell
        if px < BORDER_MIN_PX:
            return
        exposed = option.exposedRect if option is not None else self.boundingRect()
        w = self.width
        c0, c1 = max(0, int(exposed.left())), min(w, int(np.ceil(exposed.right())))
        r0 = max(0, int(exposed.top()))
        r1 = min(-(-self.num_blocks // w), int(np.ceil(exposed.bottom())))
        blocks = [b for r in range(r0, r1) for b in range(r * w + c0, min(r * w + c1,
                                                                           self.num_blocks))]
        if not blocks:
            return
        pen = QPen(self._border)
        pen.setCosmetic(True)
        pen.setWidthF(1.0 if px < 14 else 1.5)
        painter.setPen(pen)
        painter.setBrush(Qt.BrushStyle.NoBrush)
        painter.drawRects([QRectF(b % w, b // w, 1, 1) for b in blocks])

        # ids: in device pixels (the item's transform would scale the font)
        font = QFont("DejaVu Sans Mono")
        size = int(min(px * 0.45, 13))
        digits = len(str(self.num_blocks - 1))
        font.setPixelSize(max(1, size))
        fm = QFontMetrics(font)
        while size >= LABEL_MIN_FONT_PX and fm.horizontalAdvance("8" * digits) > px - 3:
            size -= 1
            font.setPixelSize(size)
            fm = QFontMetrics(font)
        if size < LABEL_MIN_FONT_PX:
            return
        painter.save()
        painter.resetTransform()
        painter.setFont(font)
        light, dark = QColor(230, 233, 240), QColor(20, 22, 28)
        codes = self.codes
        for b in blocks:
            row, col = divmod(b, w)
            centre = tr.map(QPointF(col + 0.5, row + 0.5))
            dark_text = codes is not None and b < codes.size and self._dark_text[codes[b]]
            painter.setPen(dark if dark_text else light)
            painter.drawText(QRectF(centre.x() - px / 2, centre.y() - px / 2, px, px),
                             Qt.AlignmentFlag.AlignCenter, str(b))
        painter.restore()
