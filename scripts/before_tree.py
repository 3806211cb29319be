"""An earlier commit's files, for the A/B scripts' ``--before REF`` (each runs the old code
beside this tree's, in its own process, from the exported copy)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def export_tree(rev: str, dest: Path, *paths: str) -> Path:
    """Write ``paths`` of commit ``rev`` (default: its whole tree) under ``dest``, created if
    needed; returns ``dest``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, *paths], check=True,
                             capture_output=True).stdout
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest
