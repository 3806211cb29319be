"""Legends that never overlap: each entry is its own small label in a flow layout, so a
narrow window moves whole entries onto the next line and the layout grows by that line
(``heightForWidth``) instead of wrapping text over the widget below.

``FlowLayout`` is Qt's flow-layout example in Python; ``Legend`` holds entries of
(swatch colour, swatch glyph, text, optional count).
"""

from __future__ import annotations

from PySide6.QtCore import QMargins, QPoint, QRect, QSize, Qt, QTimer
from PySide6.QtWidgets import QLabel, QLayout, QLayoutItem, QSizePolicy, QWidget

from kvscope.inspector import palette as P


class FlowLayout(QLayout):
    """Items left to right, wrapping to a new row when the next would not fit."""

    def __init__(self, parent: QWidget | None = None, h_spacing: int = 12,
                 v_spacing: int = 2) -> None:
        super().__init__(parent)
        self._items: list[QLayoutItem] = []
        self._h, self._v = h_spacing, v_spacing
        self.setContentsMargins(0, 0, 0, 0)

    def addItem(self, item: QLayoutItem) -> None:  # noqa: N802 - Qt's name
        self._items.append(item)

    def count(self) -> int:
        return len(self._items)

    def itemAt(self, i: int) -> QLayoutItem | None:  # noqa: N802
        return self._items[i] if 0 <= i < len(self._items) else None

    def takeAt(self, i: int) -> QLayoutItem | None:  # noqa: N802
        return self._items.pop(i) if 0 <= i < len(self._items) else None

    def expandingDirections(self) -> Qt.Orientation:  # noqa: N802
        return Qt.Orientation(0)

    def hasHeightForWidth(self) -> bool:  # noqa: N802
        return True

    def heightForWidth(self, width: int) -> int:  # noqa: N802
        return self._place(QRect(0, 0, width, 0), move=False)

    def setGeometry(self, rect: QRect) -> None:  # noqa: N802
        super().setGeometry(rect)
        self._place(rect, move=True)

    def sizeHint(self) -> QSize:  # noqa: N802
        return self.minimumSize()

    def minimumSize(self) -> QSize:  # noqa: N802
        # As narrow as the widest entry: wider windows lay entries out on fewer lines.
        size = QSize()
        for item in self._items:
            size = size.expandedTo(item.minimumSize())
        m: QMargins = self.contentsMargins()
        return size + QSize(m.left() + m.right(), m.top() + m.bottom())

    def _place(self, rect: QRect, move: bool) -> int:
        m = self.contentsMargins()
        area = rect.adjusted(m.left(), m.top(), -m.right(), -m.bottom())
        x, y, line_h = area.x(), area.y(), 0
        for item in self._items:
            if item.widget() is not None and item.widget().isHidden():
                continue
            hint = item.sizeHint()
            if x > area.x() and x + hint.width() > area.right() + 1:
                x, y, line_h = area.x(), y + line_h + self._v, 0
            if move:
                item.setGeometry(QRect(QPoint(x, y), hint))
            x += hint.width() + self._h
            line_h = max(line_h, hint.height())
        return y + line_h - rect.y() + m.bottom()


class Legend(QWidget):
    """A row of legend entries that flows onto more lines when narrow."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.flow = FlowLayout(self)
        sp = QSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Preferred)
        sp.setHeightForWidth(True)
        self.setSizePolicy(sp)
        self.labels: list[QLabel] = []
        self._fit_pending = False

    def set_entries(self, entries: list[tuple[str, str, str, str]]) -> None:
        """``entries``: (colour, glyph, text, count text or ""). Reuses the labels when the
        number of entries is unchanged (counts update every frame)."""
        changed = len(entries) != len(self.labels)
        if changed:
            for lab in self.labels:
                self.flow.removeWidget(lab)
                lab.deleteLater()
            self.labels = []
            for _ in entries:
                lab = QLabel()
                lab.setTextFormat(Qt.TextFormat.RichText)
                lab.setWordWrap(False)
                self.flow.addWidget(lab)
                self.labels.append(lab)
        for lab, (colour, glyph, text, count) in zip(self.labels, entries, strict=True):
            html = (f"<span style='color:{colour}'>{glyph}</span>&nbsp;{text}"
                    + (f"&nbsp;<span style='color:{P.TEXT_DIM}'>{count}</span>" if count
                       else ""))
            if lab.text() != html:
                lab.setText(html)  # a wider text re-lays the flow (updateGeometry)
                changed = True
        if changed and not self._fit_pending:  # measured once, when the event loop lays out
            self._fit_pending = True
            QTimer.singleShot(0, self, self._fit_height)  # dropped if the legend is gone

    def resizeEvent(self, event) -> None:  # noqa: ANN001, N802 - Qt's name
        super().resizeEvent(event)
        self._fit_height()

    def _fit_height(self) -> None:
        """Ask for the height the entries need at this width, as a minimum: splitters and
        box layouts then shrink the view below the legend, never the legend into it."""
        self._fit_pending = False
        need = self.flow.heightForWidth(max(1, self.width()))
        if need != self.minimumHeight():
            self.setMinimumHeight(need)

    def text(self) -> str:
        """The entries' rich text, one after another (what the legend says)."""
        return " ".join(lab.text() for lab in self.labels)
