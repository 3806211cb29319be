"""Offscreen screenshots of the inspector's analysis views from a recording (the README's
images: docs/img/analysis-*.png).

    .venv/bin/python scripts/analysis_screenshots.py demo-out/demo.kvtrace [--out docs/img]

Opens the recording in the inspector window and saves: the whole window with the
analysis dock (lifecycle tab, a sequence selected), the block map (a small pool: borders
and block ids), the timelines with their cost rows, the lifecycle Gantt, the range
summary of the busiest third of the run, the two-moment compare (quietest vs busiest
step), the prefix tree with its top node selected, the whole window with alert banners
and threshold lines on, and a narrow window (legends flowing onto more lines).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recording")
    ap.add_argument("--out", default=str(ROOT / "docs" / "img"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QApplication

    from kvscope.inspector import analysis
    from kvscope.inspector.app import make_app, open_recording
    from kvscope.inspector.window import MainWindow

    app = make_app(offscreen=True)
    rec, notes = open_recording(args.recording)
    for n in notes:
        print(n, file=sys.stderr)
    win = MainWindow()
    win.resize(1800, 1250)
    win.show()
    win.open_replay(rec, Path(args.recording).name)
    from PySide6.QtWidgets import QDockWidget

    dock = win.findChild(QDockWidget, "analysis")
    win.resizeDocks([dock], [380], Qt.Orientation.Vertical)
    panel = win.analysis
    idx = panel.index
    st = idx.steps
    used = st["gpu_used"]
    busiest = int(st["step"][int(used.argmax())])
    quiet = int(st["step"][max(0, int(used.argmax()) // 4)])

    def settle() -> None:
        for _ in range(5):
            app.processEvents()

    def save(widget, name: str) -> None:
        settle()
        path = out / f"analysis-{name}.png"
        if not widget.grab().save(str(path), "PNG"):
            raise OSError(f"cannot write {path}")
        print(f"wrote {path}")

    win.replay.seek_step(busiest)
    victim = next((sid for sid, _ in idx.preemptions), None)
    sel = victim if victim in win.model.state.seqs else next(
        (s for s in idx.order if s in win.model.state.seqs), None)
    if sel:
        panel._row_clicked(sel)
    panel.show_tab(analysis.TAB_LIFECYCLE)
    save(win, "window")
    win.model.select_seq(None)  # the map's own colours, nothing dimmed
    save(win.block_map, "blockmap")
    if sel:
        win.model.select_seq(sel)
    save(win.timelines, "timelines")
    win.resizeDocks([dock], [560], Qt.Orientation.Vertical)  # room for the tall pages
    save(panel.lifecycle, "lifecycle")

    n = len(st["step"])
    a, b = int(st["step"][n // 3]), int(st["step"][2 * n // 3])
    panel._range_selected(a, b)
    save(panel, "range")

    win.replay.seek_step(quiet)
    panel._pin("A")
    win.replay.seek_step(busiest)
    panel._pin("B")
    panel.show_tab(analysis.TAB_COMPARE)
    save(panel, "compare")

    panel.show_tab(analysis.TAB_PREFIXES)
    panel.prefix.refresh()
    tree = panel.prefix.tree
    if tree.topLevelItemCount():
        tree.setCurrentItem(tree.topLevelItem(0))
        tree.expandAll()
    save(panel, "prefix")
    save(win.block_map, "prefix-blocks")
    tree.clearSelection()
    win.model.set_highlight(None)

    panel.alert_controls["enabled"].setChecked(True)
    panel.alert_controls["max_utilization"].setValue(80)
    panel.show_tab(analysis.TAB_ALERTS)
    win.resizeDocks([dock], [300], Qt.Orientation.Vertical)
    win.replay.seek_step(busiest)
    save(win, "alerts")
    panel.alert_controls["enabled"].setChecked(False)

    panel.show_tab(analysis.TAB_LIFECYCLE)
    win.resize(1000, 900)
    save(win, "narrow")
    QApplication.instance().processEvents()
    win.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
