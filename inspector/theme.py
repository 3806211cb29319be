"""Apply the dark theme (``inspector.palette``) to Qt widgets and pyqtgraph."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtGui import QColor, QFont, QPalette
from PySide6.QtWidgets import QApplication

from kvscope.inspector import palette as P


def apply(app: QApplication) -> None:
    """Theme the application once (re-styling a live app restyles every widget: slow)."""
    if app.property("kvscope_theme"):
        return
    app.setProperty("kvscope_theme", True)
    # row-major: image[row, col], so block b sits at divmod(b, width) (see views.block_map).
    pg.setConfigOptions(antialias=True, background=P.PANEL, foreground=P.TEXT,
                        imageAxisOrder="row-major")
    app.setStyle("Fusion")
    pal = QPalette()
    for role, colour in (
        (QPalette.ColorRole.Window, P.BG), (QPalette.ColorRole.Base, P.PANEL),
        (QPalette.ColorRole.AlternateBase, P.PANEL_2), (QPalette.ColorRole.Text, P.TEXT),
        (QPalette.ColorRole.WindowText, P.TEXT), (QPalette.ColorRole.Button, P.PANEL_2),
        (QPalette.ColorRole.ButtonText, P.TEXT), (QPalette.ColorRole.Highlight, "#2f5d86"),
        (QPalette.ColorRole.ToolTipBase, P.PANEL_2), (QPalette.ColorRole.ToolTipText, P.TEXT),
    ):
        pal.setColor(role, QColor(colour))
    app.setPalette(pal)
    font = QFont("DejaVu Sans")
    font.setPointSize(10)
    app.setFont(font)
    app.setStyleSheet(P.STYLESHEET)
