"""DiskIO: host blocks to files and back off the engine thread; a full queue drops and
counts; the drain writes what is queued."""

from __future__ import annotations

import logging
import threading
import time

import torch

from kvscope.engine.cache.transfers import FILL, DiskOp
from kvscope.engine.runner import disk_io
from kvscope.engine.runner.disk_io import DiskIO
from kvscope.engine.runner.disk_store import DiskStore, fingerprint
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
    # a read's deadline (2 s by default, then abandoned as a miss) is a hang guard here:
    # a loaded box may take longer between a read's start and the test's look at it; the
    # tests of abandoned reads set their own short one
    return DiskIO(store, tensors, queue_blocks, read_timeout_s=HANG_S)


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


def test_reads_run_side_by_side_and_are_handed_on_in_start_order(tmp_path):
    """Several readers: a read that finishes before an earlier one waits for it (an
    adopted block's parent must become host cache first); ``wait_reads`` returns once
    every read is done; read buffers are reused after the install."""
    ts = host_tensors()
    io = make(tmp_path, ts)
    gate, first_started = threading.Event(), threading.Event()
    real = io.store.read

    def read(h, *a, **k):  # block 100's read does not move until the test lets it
        if h == 100:
            first_started.set()
            gate.wait(HANG_S)
        return real(h, *a, **k)

    try:
        for y in range(2):
            assert io.save(y, y, 100 + y, 0, True, (y, 0, 0, 0))
        assert io.drain(time.monotonic() + HANG_S) == 0
        io.store.read = read
        io.load(0, 100, 0, (0, 0, 0, 0))
        assert first_started.wait(HANG_S)
        io.load(1, 101, 0, (1, 0, 0, 0))
        wait_until(lambda: io.stats.loaded == 1, "the second read, on another reader")
        assert io.take_loaded() == [] and not io.wait_reads(0)
        gate.set()
        assert io.wait_reads(HANG_S)
        done, arrived, disabled = io.results()
        assert arrived == [(0, True), (1, True)] and not disabled
        io.perform([DiskOp(FILL, 0, 100, host=4), DiskOp(FILL, 1, 101, host=5)])
        for t in ts:
            assert torch.equal(t[4:6].view(torch.uint8), t[0:2].view(torch.uint8))
        assert len(io._buffers) == 2  # both buffers back for the next reads
    finally:
        gate.set()
        io.close()


def _stall(io, stuck_hashes):
    """Make reads of ``stuck_hashes`` block until the returned event is set (a block file
    on a hung server); other reads go through."""
    gate = threading.Event()
    real = io.store.read

    def read(h, *a, **kw):
        if h in stuck_hashes:
            gate.wait()
        return real(h, *a, **kw)

    io.store.read = read
    return gate


def test_a_stuck_read_is_abandoned_and_does_not_hold_up_the_reads_behind_it(tmp_path):
    """Defect 5: reads were handed on in start order, so one read that never finished
    held back every read started after it, forever, and nothing was reported. Now it is
    handed on as a miss once its deadline passes; the reads behind it arrive intact."""
    ts = host_tensors()
    io = make(tmp_path, ts)
    gate = _stall(io, {100})
    try:
        for y in range(3):
            assert io.save(y, y, 100 + y, 99 + y, y == 0, (y, y, y, y))
        assert io.drain(time.monotonic() + HANG_S) == 0
        # a short deadline: the stuck read never finishes while the gate is shut, so
        # this only decides when it is given up on, never whether a test passes
        io.read_timeout_s = 0.05
        for y in range(3):
            io.load(y, 100 + y, 99 + y, (y, y, y, y))
        got = []
        wait_until(lambda: got.extend(io.take_loaded()) or len(got) == 3,
                   "the reads behind a stuck one")
        assert [(j.slot, j.data is not None) for j in got] == [(0, False), (1, True),
                                                               (2, True)]
        assert io.stats.read_timeouts == 1 and not io.store.disabled
        gate.set()  # the stuck read finishes late: its result is dropped, not handed on
        wait_until(lambda: io.wait_reads(0) and not io._reading, "the late read")
        assert io.take_loaded() == [] and io.stats.loaded == 2
    finally:
        gate.set()
        io.close()


def test_reads_that_keep_timing_out_turn_the_tier_off_loudly(tmp_path, caplog):
    """Several abandoned reads in a row disable the store with one warning (the cache
    manager then forgets the tier's blocks with evict events, reason disk_failed), and a
    stop does not wait for the stuck readers."""
    ts = host_tensors()
    io = make(tmp_path, ts)
    stuck = {100 + y for y in range(disk_io.READ_FAILS_TO_DISABLE)}
    gate = _stall(io, stuck)
    try:
        for y in range(len(stuck)):
            assert io.save(y, y, 100 + y, 99 + y, y == 0, (y, y, y, y))
        assert io.drain(time.monotonic() + HANG_S) == 0
        io.read_timeout_s = 0.05
        with caplog.at_level(logging.WARNING):
            for y in range(len(stuck)):
                io.load(y, 100 + y, 99 + y, (y, y, y, y))
            got = []
            wait_until(lambda: got.extend(io.take_loaded()) or len(got) == len(stuck),
                       "every stuck read abandoned")
        assert all(j.data is None for j in got)
        assert io.stats.read_timeouts == len(stuck)
        done, _, disabled = io.results()
        assert disabled and io.store.disabled
        assert caplog.text.count("disabled") == 1 and "did not finish" in caplog.text
        io.close()  # returns with the readers still stuck (they are daemon threads)
    finally:
        gate.set()
