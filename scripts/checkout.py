"""Run the code of any checkout of this repository without installing it.

Installed, the rooms are one package (setup.py): ``assets/`` is ``kvscope`` and
``engine/``, ``inspector/``, ``kernels/`` are inside it. ``importable(root)`` builds that
package from symlinks in a scratch folder and returns the folder, for PYTHONPATH or
sys.path: what the A/B harnesses and the device scripts use to load the tree at ``root``
(this one, or an earlier revision exported with ``git archive``)."""

from __future__ import annotations

import tempfile
from pathlib import Path

ROOMS = ("engine", "inspector", "kernels")


def importable(root: str | Path) -> str:
    root = Path(root).resolve()
    shim = Path(tempfile.mkdtemp(prefix="kvscope-path-")) / "kvscope"
    shim.mkdir()
    entries = [*(root / "assets").iterdir(), *(root / r for r in ROOMS if (root / r).exists())]
    for entry in entries:
        (shim / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    return str(shim.parent)
