"""DiskIO: the disk tier's tensor side: host blocks to files and back, off the engine thread.

The engine thread only ever enqueues. ``save`` copies one host block's bytes (every
per-block tensor's row, a memcpy) and queues the job (at most ``queue_blocks`` saves
wait); a writer thread writes the file (engine.runner.disk_store). When the queue is
full the block is dropped and counted (``dropped``): a slow disk costs cache hits,
never engine time. ``load`` queues a read; one of ``readers`` threads reads and verifies
the file into a staging buffer, and ``install`` copies verified bytes into a host block on
the engine thread (op FILL). Reads finish in any order but are handed on in the order
they were started (an adopted block's parent must become host cache before it).

A read that has not finished ``read_timeout_s`` after it started (a hung NFS server, a
stuck device) is abandoned: it is handed on as a miss, so the reads behind it are not
held up, and its result is thrown away whenever its reader gets it. ``READ_FAILS_TO_DISABLE``
abandoned reads in a row (no read finishing in between) turn the tier off loudly: the
store's one warning, ``stats.read_timeouts`` and the ``kv_tier_disabled`` gauge on
/metrics, and the cache manager's ``evict`` events (tier disk, reason ``disk_failed``)
for every block it forgets, which the inspector shows. A stop does not wait for a stuck
reader (they are daemon threads) longer than ``read_timeout_s``.

Why several readers and ``wait_reads``: a read is a few blocking calls (open, read, crc32,
close), each of which gives up the GIL and must take it back. While the engine thread runs
Python (an idle step polling for arrivals), each take-back waits for the interpreter's
switch interval, so one reader next to a busy engine thread got about a tenth of the
disk's rate. The engine's idle wait therefore blocks in ``wait_reads`` (holding no GIL)
instead of polling, and several readers keep several files in flight when the engine does
compute.
``perform`` runs one ``DiskBatch`` of the cache manager's ops in order (SAVE, LOAD, FILL,
DROP; deletes share the writer's queue, so a file is never deleted before an earlier
write of it). Every job's outcome comes back through ``results``, keyed by the manager's
disk block,
so the cache manager learns which disk entries really exist and which reads arrived: it
never serves a block whose file was not written, nor schedules a sequence against a block
whose read has not arrived.

``drain(deadline_s)`` waits for the writer to finish queued saves, at most until the
deadline (the SIGTERM drain); what is left is dropped (the manager's index then forgets
those blocks; nothing on disk is wrong).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from kvscope.engine.cache.transfers import DROP, FILL, LOAD, SAVE, DiskOp
from kvscope.engine.runner.disk_store import DiskStore, fingerprint


@dataclass(slots=True)
class SaveJob:
    slot: int
    hash: int
    parent: int
    first: bool
    tokens: tuple[int, ...]
    pieces: list[memoryview]


@dataclass(slots=True)
class DropJob:
    hash: int


@dataclass(slots=True)
class LoadJob:
    slot: int
    hash: int
    parent: int
    tokens: tuple[int, ...]
    data: memoryview | None = None  # the verified payload, or None: a miss
    seconds: float = 0.0
    done: bool = False  # set by the reader after ``data``
    buf: Any = None  # the read buffer ``data`` views (back to the pool once installed)
    deadline: float = 0.0  # monotonic time after which the read is abandoned
    abandoned: bool = False  # handed on as a miss before it finished (its result is lost)


@dataclass
class DiskIOStats:
    saved: int = 0  # files written
    dropped: int = 0  # saves dropped: the queue was full (or the store disabled)
    failed: int = 0  # saves or reads that failed
    read_timeouts: int = 0  # reads abandoned: not finished within ``read_timeout_s``
    loaded: int = 0  # blocks read and verified
    load_misses: int = 0  # reads that found no intact file
    bytes_written: int = 0
    bytes_read: int = 0
    write_s: float = 0.0
    read_s: float = 0.0  # summed over reads (several run at once)
    read_busy_s: float = 0.0  # wall time with at least one read in flight
    extra: dict[str, float] = field(default_factory=dict)


_STOP = object()
MAX_IDLE_BUFFERS = 64  # read buffers kept for reuse (64 x one block's file)
# A read not done this long after it started is abandoned (a miss). The engine's prefetch
# waits 2 s (engine.scheduler) for the same reads: a later arrival helps no one.
READ_TIMEOUT_S = 2.0
READ_FAILS_TO_DISABLE = 3  # abandoned reads in a row that turn the tier off


def open_disk(directory: str, model: str, fmt_name: str, block_size: int,
              host_tensors: list[torch.Tensor]) -> DiskIO:
    """The disk tier over ``directory`` for blocks shaped like ``host_tensors``' rows (the
    host tier's tensors, which its reads and writes go through)."""
    specs = [(tuple(t.shape[1:]), str(t.dtype).removeprefix("torch.")) for t in host_tensors]
    payload = sum(t[0].numel() * t.element_size() for t in host_tensors)
    store = DiskStore(directory, fingerprint(model, fmt_name, block_size, specs), block_size,
                      payload, exclusive=True)
    return DiskIO(store, host_tensors)


class DiskIO:
    def __init__(self, store: DiskStore, host_tensors: list[torch.Tensor],
                 queue_blocks: int = 256, readers: int = 4,
                 read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.store = store
        self.read_timeout_s = read_timeout_s
        self._stuck_in_a_row = 0  # reads abandoned since the last one that finished
        self.host_tensors = host_tensors
        # bytes views of the host tensors: row y of tensor i is views[i][y]
        self._views = [t.view(torch.uint8).reshape(t.shape[0], -1) for t in host_tensors]
        self.payload_bytes = sum(v.shape[1] for v in self._views)
        if self.payload_bytes != store.payload_bytes:
            raise ValueError("the store's payload size does not match the host tensors")
        self.stats = DiskIOStats()
        self.queue_blocks = queue_blocks
        # set while the engine stops: saves wait (until then) for room instead of dropping
        self.persist_until: float | None = None
        self._closing = False
        self._saves: queue.Queue = queue.Queue()  # saves (bounded by count) and drops
        self._loads: queue.Queue = queue.Queue()
        self._done: deque[tuple[int, int, bool]] = deque()  # (slot, hash, written?)
        self._reads: deque[LoadJob] = deque()  # started reads in start order (engine thread)
        self._read_cv = threading.Condition()  # guards the counters below and ``stats`` reads
        self._unfinished = 0  # reads started and not done
        self._reading = 0  # reads in progress right now (busy-time accounting)
        self._busy_since = 0.0
        self._buffers: list[Any] = []  # idle read buffers (reused: fresh pages cost zeroing)
        self._staged: dict[int, LoadJob] = {}  # arrived reads by slot, until FILLed
        self._idle = threading.Condition()
        self._pending_saves = 0
        self._threads = [threading.Thread(target=self._writer, name="kv-disk-writer",
                                          daemon=True)]
        self._threads += [threading.Thread(target=self._reader, name=f"kv-disk-reader-{i}",
                                           daemon=True) for i in range(max(1, readers))]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------- engine thread
    def perform(self, batch: list[DiskOp]) -> None:
        """The cache manager's disk ops, in order (engine.cache.transfers)."""
        for op in batch:
            if op.kind == SAVE:
                self.save(op.host, op.slot, op.hash, op.parent, op.first, op.tokens)
            elif op.kind == FILL:
                job = self._staged.pop(op.slot, None)
                if job is None or job.hash != op.hash or job.data is None:
                    raise RuntimeError(f"disk block {op.slot} filled without its read")
                self.install(job, op.host)
            elif op.kind == LOAD:
                self.load(op.slot, op.hash, op.parent, op.tokens)
            elif op.kind == DROP:
                self._saves.put(DropJob(op.hash))
            else:
                raise ValueError(f"unknown disk op {op.kind!r}")

    def save(self, host_block: int, slot: int, h: int, parent: int, first: bool,
             tokens: tuple[int, ...]) -> bool:
        """Queue host block ``host_block``'s bytes for writing as block ``h`` (the
        manager's disk block ``slot``); False (dropped, counted) when ``queue_blocks``
        saves are queued already or the store is disabled."""
        with self._idle:
            while self._pending_saves >= self.queue_blocks and not self.store.disabled \
                    and self.persist_until is not None:
                left = self.persist_until - time.monotonic()
                if left <= 0:
                    break
                self._idle.wait(left)
            if self.store.disabled or self._pending_saves >= self.queue_blocks:
                self.stats.dropped += 1
                self._done.append((slot, h, False))
                return False
            self._pending_saves += 1
        pieces = [memoryview(v[host_block].numpy().copy()) for v in self._views]
        self._saves.put(SaveJob(slot, h, parent, first, tokens, pieces))
        return True

    def load(self, slot: int, h: int, parent: int, tokens: tuple[int, ...]) -> None:
        """Queue a read of block ``h``; its outcome comes back from ``take_loaded``."""
        job = LoadJob(slot, h, parent, tokens,
                      deadline=time.monotonic() + self.read_timeout_s)
        with self._read_cv:
            self._unfinished += 1
        self._reads.append(job)
        self._loads.put(job)

    def wait_reads(self, timeout_s: float) -> bool:
        """Block (holding no GIL) until every started read is done, ``timeout_s`` passes
        or the oldest read's deadline passes (it is then abandoned by ``take_loaded``);
        True when none is left unfinished."""
        if self._reads:
            timeout_s = min(timeout_s, max(0.0, self._reads[0].deadline - time.monotonic()))
        with self._read_cv:
            return self._read_cv.wait_for(lambda: self._unfinished == 0, timeout_s)

    def results(self) -> tuple[list[tuple[int, int, bool]], list[tuple[int, bool]], bool]:
        """What the cache manager's ``disk_results`` takes: finished saves, arrived reads
        (kept staged for this step's FILL ops; staged reads not filled by the next call
        are let go) and whether the store is disabled."""
        loaded = self.take_loaded()
        for job in self._staged.values():  # not filled: let go
            self._release(job)
        self._staged = {j.slot: j for j in loaded if j.data is not None}
        return self.take_done(), [(j.slot, j.data is not None) for j in loaded], \
            self.store.disabled

    def take_done(self) -> list[tuple[int, int, bool]]:
        """(slot, hash, written?) of every save finished (or dropped) since the last
        call."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def take_loaded(self) -> list[LoadJob]:
        """The reads finished since the last call, in the order they were started (a read
        done before an earlier one waits for it; ``data`` None: a miss). A read past its
        deadline is abandoned here and handed on as a miss (a fresh job: the reader may
        still write into the old one), so one stuck read holds up the others at most
        ``read_timeout_s``."""
        out = []
        reads = self._reads
        now = None
        while reads:
            job = reads[0]
            if not job.done:
                now = time.monotonic() if now is None else now
                if now < job.deadline:
                    break
                if self._abandon(job):  # else it finished meanwhile: handed on below
                    reads.popleft()
                    out.append(LoadJob(job.slot, job.hash, job.parent, job.tokens,
                                       done=True, abandoned=True))
                    continue
            out.append(reads.popleft())
        return out

    def _abandon(self, job: LoadJob) -> bool:
        """Give up on ``job`` (not done by its deadline); False if it finished meanwhile.
        Disables the store after ``READ_FAILS_TO_DISABLE`` in a row."""
        with self._read_cv:
            if job.done:
                return False
            job.abandoned = True
            self._unfinished -= 1
            self.stats.read_timeouts += 1
            self.stats.load_misses += 1
            self._stuck_in_a_row += 1
            stuck = self._stuck_in_a_row
            self._read_cv.notify_all()
        if stuck >= READ_FAILS_TO_DISABLE:
            self.store.disable(f"{stuck} reads in a row did not finish within "
                               f"{self.read_timeout_s:g} s")
        return True

    def install(self, job: LoadJob, host_block: int) -> None:
        """Copy a verified read into host block ``host_block``."""
        data = job.data
        off = 0
        for v in self._views:
            n = v.shape[1]
            v[host_block].copy_(torch.frombuffer(data[off:off + n], dtype=torch.uint8))
            off += n
        self._release(job)

    def _release(self, job: LoadJob) -> None:
        """Give ``job``'s read buffer back to the pool (its ``data`` is gone)."""
        buf, job.buf, job.data = job.buf, None, None
        if buf is not None:
            with self._read_cv:
                if len(self._buffers) < MAX_IDLE_BUFFERS:
                    self._buffers.append(buf)
    def read_now(self, h: int, parent: int, tokens: tuple[int, ...],
                 host_block: int) -> bool:
        """Read block ``h`` into ``host_block`` on this thread (tests, benchmarks)."""
        job = LoadJob(-1, h, parent, tokens)
        self._read(job)
        if job.data is None:
            return False
        self.install(job, host_block)
        return True

    def drain(self, deadline_s: float) -> int:
        """Wait until every queued save is written or ``deadline_s`` (monotonic) passes;
        returns how many saves are still pending."""
        with self._idle:
            while self._pending_saves:
                left = deadline_s - time.monotonic()
                if left <= 0:
                    break
                self._idle.wait(left)
            return self._pending_saves

    def close(self) -> None:
        """Stop the threads; saves still queued are abandoned (never half-written: a file
        appears only by its final rename)."""
        self._closing = True
        self._saves.put(_STOP)
        for _ in self._threads[1:]:
            self._loads.put(_STOP)
        self._threads[0].join(timeout=30)
        # a reader stuck in a read that never returns is left behind (a daemon thread): a
        # healthy one finishes its read and its STOP well within one read's deadline
        end = time.monotonic() + self.read_timeout_s
        for t in self._threads[1:]:
            t.join(timeout=max(0.0, end - time.monotonic()))
        self.store.close()

    # ------------------------------------------------------------- workers
    def _writer(self) -> None:
        while True:
            job = self._saves.get()
            if job is _STOP:
                return
            if isinstance(job, DropJob):
                self.store.remove(job.hash)
                continue
            if self._closing:
                with self._idle:
                    self.stats.dropped += 1
                    self._pending_saves -= 1
                continue
            t0 = time.perf_counter()
            ok = self.store.write(job.hash, job.parent, job.first, job.tokens, job.pieces)
            dt = time.perf_counter() - t0
            st = self.stats
            if ok:
                st.saved += 1
                st.bytes_written += self.store.file_bytes
            else:
                st.failed += 1
            st.write_s += dt
            with self._idle:
                self._done.append((job.slot, job.hash, ok))
                self._pending_saves -= 1
                self._idle.notify_all()

    def _reader(self) -> None:
        while True:
            job = self._loads.get()
            if job is _STOP:
                return
            self._read(job)
            with self._read_cv:
                if job.abandoned:  # handed on as a miss already: the result is dropped
                    if job.buf is not None and len(self._buffers) < MAX_IDLE_BUFFERS:
                        self._buffers.append(job.buf)
                    job.buf = job.data = None
                    continue
                self._stuck_in_a_row = 0
                job.done = True
                self._unfinished -= 1
                self._read_cv.notify_all()

    def _read(self, job: LoadJob) -> None:
        t0 = time.perf_counter()
        with self._read_cv:
            if not self._reading:
                self._busy_since = t0
            self._reading += 1
            job.buf = self._buffers.pop() if self._buffers else None
        if job.buf is None:
            job.buf = self.store.buffer()
        job.data = self.store.read(job.hash, job.parent, job.tokens, job.buf)
        t1 = time.perf_counter()
        job.seconds = t1 - t0
        with self._read_cv:
            st = self.stats
            self._reading -= 1
            if not self._reading:
                st.read_busy_s += t1 - self._busy_since
            st.read_s += job.seconds
            if job.abandoned:
                pass  # counted as a miss when it was abandoned; _reader drops the result
            elif job.data is None:
                st.load_misses += 1
                if len(self._buffers) < MAX_IDLE_BUFFERS:
                    self._buffers.append(job.buf)
                job.buf = None
            else:
                st.loaded += 1
                st.bytes_read += len(job.data)
