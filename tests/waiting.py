"""Waiting in tests: for a condition or an event, never for a length of time.

Every deadline here is a hang guard only. A healthy run meets its condition in a small
fraction of it, also on a loaded machine, and no test asserts how long anything took: a
slow box makes a test slower, never red.
"""

from __future__ import annotations

import time
from collections.abc import Callable

HANG_S = 300.0  # how long a wait may take before the test calls it a hang, never a speed
HANG_MS = int(HANG_S * 1000)  # for qtbot.waitUntil


def wait_until(done: Callable[[], bool], what: str, timeout: float = HANG_S,
               poll_s: float = 0.002) -> None:
    """Return once ``done()`` is true; fail the test if it never becomes true (``what``
    says which condition, for the failure message). ``poll_s`` only paces the checks."""
    end = time.monotonic() + timeout
    while not done():
        if time.monotonic() > end:
            raise AssertionError(f"gave up after {timeout:.0f} s waiting for {what}")
        time.sleep(poll_s)
