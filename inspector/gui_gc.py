"""Cycle collection on the GUI thread only.

CPython's cycle collector runs on whichever thread happens to allocate when a generation's
threshold trips. The live sources run Python threads beside the GUI (the Subscriber that
drains the event stream, the router's and vLLM's listeners), and they allocate fast. When
such a thread trips a collection that frees a Qt object left in a reference cycle, Qt
destroys it off the GUI thread: a segfault, a glibc abort or a deadlock against
shiboken's deferred deletions (all three seen under the live flood test; gdb showed
``QObject::~QObject`` inside ``gc_collect_main`` on a non-GUI thread).

So an inspector process collects on the GUI thread, on a timer, with pyqtgraph's
``GarbageCollector`` (the library's own answer to this): automatic collection is off, and
every ``INTERVAL_S`` the timer collects the generations whose thresholds were crossed.
Invariant while installed: no cycle is freed on any thread but the GUI thread.
"""

from __future__ import annotations

import gc

from pyqtgraph.util.garbage_collector import GarbageCollector

INTERVAL_S = 0.1  # a flood's young cycles wait at most this long; a check is ~µs

_collector: GarbageCollector | None = None


def install() -> None:
    """Collect on the GUI thread from now on (idempotent). Call from the GUI thread once
    the QApplication exists: the timer lives on the thread that creates it."""
    global _collector
    if _collector is None:
        _collector = GarbageCollector(interval=INTERVAL_S)


def uninstall() -> None:
    """Back to automatic collection, after collecting what is garbage now, here (the GUI
    thread), so no Qt object is left for a worker thread's collection to free."""
    global _collector
    if _collector is not None:
        _collector.timer.stop()
        _collector = None
        gc.collect()
        gc.enable()


def installed() -> bool:
    return _collector is not None
