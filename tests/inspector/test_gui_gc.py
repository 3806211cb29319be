"""Qt objects in reference cycles are freed on the GUI thread only, however hard a worker
thread allocates (the live sources run such threads; inspector/gui_gc.py says why)."""

from __future__ import annotations

import gc
import threading

from kvscope.inspector import gui_gc
from tests.waiting import HANG_MS


class _Finalized:
    """Records the thread that frees it."""

    def __init__(self, where: list[str]) -> None:
        self.where = where
        self.me = self  # a cycle: only the cycle collector can free it

    def __del__(self) -> None:
        self.where.append(threading.current_thread().name)


def _churn_cycles(n: int) -> None:
    for _ in range(n):  # each iteration leaves a cycle: thresholds trip many times over
        x: list = []
        x.append(x)


def test_a_worker_threads_allocations_never_collect(app, qtbot):  # noqa: ANN001
    assert gui_gc.installed() and not gc.isenabled()
    where: list[str] = []
    _Finalized(where)
    worker = threading.Thread(target=_churn_cycles, args=(200_000,), name="worker")
    worker.start()
    worker.join()
    assert where == []  # without the guard the worker's collections free it
    qtbot.waitUntil(lambda: bool(where), timeout=HANG_MS)  # the GUI timer's collection
    assert where == [threading.main_thread().name]


def test_uninstall_collects_here_and_restores_automatic_collection(app):  # noqa: ANN001
    where: list[str] = []
    _Finalized(where)
    gui_gc.uninstall()
    assert where == [threading.main_thread().name] and gc.isenabled()
    assert not gui_gc.installed()
    gui_gc.install()  # idempotent with tests/conftest.py's own uninstall at teardown
    assert gui_gc.installed()
