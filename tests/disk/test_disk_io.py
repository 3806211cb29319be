"""DiskIO: host blocks to files and back off the engine thread; a full queue drops and
counts; the drain writes what is queued."""

from __future__ import annotations

import threading
import time

import torch

from engine.runner.disk_io import DiskIO
from engine.runner.disk_store import DiskStore, fingerprint
from tests.waiting import HANG_S, wait_until

BS = 4


def host_tensors(n=6):
    g = torch.Generator().manual_seed(0)
    return [torch.randn((n, BS, 2, 8), generator=g).to(torch.bfloat16) for _ in range(4)] \
        + [torch.randn((n, BS, 2, 1), generator=g).to(torch.float16)]


def make(tmp_path, tensors, queue_blocks=8):
    specs = [(tuple(t.shape[1:]), str(t.dtype)) for t in tensors]
    payload = sum(t[0].numel() * t.element_size() for t in tensors)
    store = DiskStore(tmp_path, fingerprint("m", "bf16", BS, specs), BS, payload)
    return DiskIO(store, tensors, queue_blocks)


def test_save_then_read_back_bit_exact(tmp_path):
    ts = host_tensors()
    io = make(tmp_path, ts)
    try:
        for y in range(3):
            assert io.save(y, y, 100 + y, 99 + y, y == 0, (y, y, y, y))
        assert io.drain(time.monotonic() + HANG_S) == 0
        assert sorted(io.take_done()) == [(0, 100, True), (1, 101, True), (2, 102, True)]
        for y in range(3):
            assert io.read_now(100 + y, 99 + y, (y, y, y, y), 3 + y)
        for t in ts:
            assert torch.equal(t[3:6].view(torch.uint8), t[0:3].view(torch.uint8))
        # queued reads come back through take_loaded; a wrong parent is a miss
        io.load(1, 101, 100, (1, 1, 1, 1))
        io.load(1, 101, 5, (1, 1, 1, 1))
        got = []
        wait_until(lambda: got.extend(io.take_loaded()) or len(got) == 2, "two reads")
        assert [j.data is not None for j in got] == [True, False]
        assert io.stats.loaded == 4 and io.stats.load_misses == 1
    finally:
        io.close()


def test_full_queue_drops_and_counts_never_waits(tmp_path):
    ts = host_tensors()
    io = make(tmp_path, ts, queue_blocks=2)
    gate = threading.Event()
    real = io.store.write

    def slow_write(*a, **k):  # a disk that does not move until the test lets it
        gate.wait(HANG_S)
        return real(*a, **k)

    io.store.write = slow_write
    try:
        results = [io.save(0, i, 200 + i, 0, True, (i, 0, 0, 0)) for i in range(6)]
        # two saves may be pending: the other four are dropped at once
        assert results.count(False) == 4 and io.stats.dropped == results.count(False)
        dropped = {h for _, h, ok in io.take_done() if not ok}
        assert len(dropped) == results.count(False)
        gate.set()
        assert io.drain(time.monotonic() + HANG_S) == 0
        written = {h for _, h, ok in io.take_done() if ok}
        assert written.isdisjoint(dropped) and len(written) == results.count(True)
    finally:
        gate.set()
        io.close()


def test_drain_gives_up_at_its_deadline(tmp_path):
    ts = host_tensors()
    io = make(tmp_path, ts)
    gate = threading.Event()
    real = io.store.write
    io.store.write = lambda *a, **k: gate.wait(HANG_S) and real(*a, **k)
    try:
        io.save(0, 0, 1, 0, True, (0, 0, 0, 0))
        assert io.drain(time.monotonic()) == 1  # a deadline already passed
    finally:
        gate.set()
        io.close()
