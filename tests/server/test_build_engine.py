"""kvscope.engine.server.daemon.build_engine: the daemon loads its engine on a short-lived thread,
so the OpenMP threads that loading starts end with it (the engine thread's team is then the
process's only one, and libgomp keeps spinning at its barriers instead of sleeping)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from kvscope.engine.server.daemon import build_engine
from tests.waiting import HANG_S


def test_builds_off_the_calling_thread_and_returns_the_engine():
    seen = []

    def factory(config):
        seen.append(threading.current_thread())
        return ("engine", config)

    assert build_engine(factory, "cfg") == ("engine", "cfg")
    assert seen and seen[0] is not threading.current_thread()


def test_the_factory_error_is_raised_to_the_caller():
    def factory(config):
        raise ValueError(f"bad config {config}")

    with pytest.raises(ValueError, match="bad config 7"):
        build_engine(factory, 7)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/task")
def test_the_loaders_openmp_threads_end_with_it():
    """In a fresh process with 2 OpenMP threads: a load that runs parallel torch ops leaves
    no thread behind when built by build_engine, where the same ops on the main thread
    leave the main thread's pool alive (the control: shows the count sees a pool)."""
    script = textwrap.dedent("""
        import os, time, torch
        from kvscope.engine.server.daemon import build_engine
        torch.set_num_threads(2)
        tasks = lambda: len(os.listdir("/proc/self/task"))
        def load(_):
            a = torch.randn(512, 512)
            for _ in range(20):
                a = torch.tanh(a @ a)  # parallel regions: a pool of OpenMP threads
            return a
        before = tasks()
        build_engine(load, None)
        # the pool threads leave when the loader's OS thread ends, just after join returns
        end = time.monotonic() + 300  # a hang guard: they leave as the loader ends
        while tasks() > before and time.monotonic() < end:
            time.sleep(0.01)
        after_build = tasks()
        load(None)  # the control: the same work on the main thread
        print(before, after_build, tasks())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=HANG_S, env={"OMP_NUM_THREADS": "2", "PATH": ""})
    assert done.returncode == 0, done.stderr
    before, after_build, after_main = map(int, done.stdout.split())
    assert after_main > before, "control failed: main-thread OpenMP work left no pool thread"
    assert after_build == before, f"the loader left {after_build - before} thread(s) behind"
