"""DiskStore: the disk tier's files, one per KV block, in a fixed binary layout (no pickle).

A file holds one full block of one chain: its chained hash, its parent's chained hash,
its token ids and its K/V bytes (every per-block tensor of the page format, in order).
The files are the index: a restarted daemon scans the directory and serves what matches
its fingerprint. Layout, little-endian::

    header  HEADER (struct below), HEADER.size bytes
            magic      8s   b"KVSCDISK"
            version    H    FORMAT_VERSION
            flags      H    bit 0: first block of its chain (parent = a salt root)
            fingerprint 16s blake2b of model, page format, block size, tensor shapes
            hash       q    the block's chained hash (engine.cache.hashing)
            parent     q    the parent's chained hash (the salt root for a first block)
            num_tokens I    == block size
            payload    Q    bytes of K/V that follow the tokens
            checksum   I    crc32 of the header up to here, the tokens and the payload
    tokens  num_tokens x uint32
    payload payload bytes

Invariants (why a file can never be served wrong):
- A file is written under a temporary name (``.tmp-*``) and renamed into place after its
  bytes are written, so a name ending in ``.kv`` is either a complete file or (after a
  crash mid-rename on a filesystem without atomic rename) one whose checksum fails.
- Every read verifies magic, version, fingerprint, the exact file size and the checksum;
  any mismatch is a miss (``None``), never bytes handed on. ``kill -9`` during a write
  leaves at most a temporary file, removed by the next scan.
- Only regular files are ever opened: a scan ``lstat``s a name before opening it, and
  every open is ``O_NOFOLLOW | O_NONBLOCK`` followed by an ``fstat`` check, so a FIFO,
  a device or a symlink named like a block file is skipped (never adopted, never
  followed, never waited on) instead of hanging the thread that met it.
- The name is ``<hash as 16 hex digits>.kv``; the header's hash must equal it.
- The directory is created private (0700). It is "ours" when it holds the marker file
  ``MARKER``: only then does a scan delete what does not match (foreign fingerprint,
  torn or unknown files); in a directory that is not ours they are left alone.
- One daemon per directory: an engine's store (``exclusive``) holds an advisory
  ``flock`` on ``LOCK`` (which names its pid) for its whole life. A second one finds it
  held and runs without a disk tier (disabled, its error names the holder's pid): it
  never scans, writes or deletes there, so it cannot break the first one's files.
- A scan deletes a temporary file ``.tmp-<pid>-*`` only when ``<pid>`` is this process
  or no live process: another live writer's file is left alone. Files a scan deletes
  (torn, another fingerprint, dead writers' temporaries) are counted and logged.
- An OSError while writing (disk full, read-only directory, I/O error) disables the
  store: one warning is logged, every later call is a no-op miss, the caller keeps
  serving. ``disabled`` says so and ``error`` names the cause.

Pure Python over bytes (no torch): the runner (engine.runner.disk_io) turns tensors into
the payload and back.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import mmap
import os
import stat
import struct
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"KVSCDISK"
FORMAT_VERSION = 1
FLAG_FIRST = 1
HEADER = struct.Struct("<8sHH16sqqIQI")
_CRC_SPAN = HEADER.size - 4  # the checksum covers the header fields before it
MARKER = ".kvscope-disk-cache"
LOCK = ".kvscope-disk-cache.lock"  # flock'ed by the daemon using the directory
SUFFIX = ".kv"
ALIGN = 4096  # O_DIRECT reads: buffer address and length are multiples of this
TMP_PREFIX = ".tmp-"


def fingerprint(model: str, kv_format: str, block_size: int,
                tensors: Sequence[tuple[tuple[int, ...], str]]) -> bytes:
    """16 bytes naming what a block's bytes mean: the model, the page format, the block
    size, and each per-block tensor's shape and dtype, in order. Two engines share files
    only when they agree on all of it."""
    text = "|".join([f"v{FORMAT_VERSION}", model, kv_format, str(block_size)]
                    + [f"{'x'.join(map(str, shape))}:{dtype}" for shape, dtype in tensors])
    return hashlib.blake2b(text.encode(), digest_size=16, person=b"kvscope-disk").digest()


def _writer_alive(name: str) -> bool:
    """Whether the temporary file ``name`` (``.tmp-<pid>-...``) belongs to another process
    that is alive (its write may be in flight). This process's own and unparsable names
    are not: a scan may delete those."""
    pid_text = name[len(TMP_PREFIX):].split("-", 1)[0]
    if not pid_text.isdigit() or int(pid_text) == os.getpid():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # EPERM: alive, another user's
    return True


@dataclass(frozen=True, slots=True)
class DiskEntry:
    """What a scan found: one servable file's identity (its K/V is read on demand)."""

    hash: int
    parent: int
    first: bool
    tokens: tuple[int, ...]
    mtime_ns: int  # the scan orders entries by it: least recently written first


def file_bytes(block_size: int, payload_bytes: int) -> int:
    """The size of one block's file."""
    return HEADER.size + 4 * block_size + payload_bytes


def file_name(h: int) -> str:
    return f"{h & 0xFFFFFFFFFFFFFFFF:016x}{SUFFIX}"


class NotRegularFile(OSError):
    """A name in the directory that is not a regular file (a FIFO, a device, a socket, a
    symlink): never read, never followed; to a read it is a miss, to a scan a skip."""


# O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever (it is
# a no-op on regular files). O_NOFOLLOW: a symlink fails with ELOOP instead of being read.
_OPEN_SAFE = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def open_regular(path: str | os.PathLike,
                 flags: int = os.O_RDONLY) -> tuple[int, os.stat_result]:
    """An fd open on ``path`` and its ``fstat``, only if ``path`` itself is a regular
    file: a symlink (ELOOP under ``O_NOFOLLOW``), a FIFO, a device or a socket raises
    NotRegularFile without blocking. Other OSErrors (ENOENT, EIO...) pass through."""
    try:
        fd = os.open(path, flags | _OPEN_SAFE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotRegularFile(errno.ELOOP, "a symlink, not followed", str(path)) from None
        raise
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, "not a regular file", str(path))
    return fd, st


class DiskStore:
    """One directory of block files for one fingerprint."""

    def __init__(self, root: str | os.PathLike, fp: bytes, block_size: int,
                 payload_bytes: int, exclusive: bool = False) -> None:
        """``exclusive``: hold the directory's lock (an engine's store); when another
        process holds it the store starts disabled."""
        if len(fp) != 16:
            raise ValueError("a fingerprint is 16 bytes")
        self.root = Path(root)
        self.fp = fp
        self.block_size = block_size
        self.payload_bytes = payload_bytes
        self.file_bytes = file_bytes(block_size, payload_bytes)
        self.disabled = False
        self.error: str | None = None
        self.direct = hasattr(os, "O_DIRECT")  # False after the filesystem refused it
        # counters
        self.written = 0
        self.read_ok = 0
        self.read_bad = 0  # files that failed verification (each a miss, then removed)
        self.removed_foreign = 0
        self.skipped_irregular = 0  # names a scan met that are not regular files
        self.bytes_written = 0
        self.bytes_read = 0
        self._lock = threading.Lock()  # reads run on several threads: counters, disable
        self._lock_fd: int | None = None  # the directory's flock, while held
        self._open_dir()
        if exclusive and not self.disabled:
            self._take_dir_lock()

    # ----------------------------------------------------------------- faults
    def _open_dir(self) -> None:
        try:
            fresh = not self.root.exists()
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            marker = self.root / MARKER
            if fresh or not any(self.root.iterdir()):
                marker.write_bytes(b"kvscope disk KV cache: files here may be deleted\n")
        except OSError as e:
            self.disable(e)

    def _take_dir_lock(self) -> None:
        """Hold ``LOCK`` (flock, exclusive, non-blocking) or disable the store, naming
        the holder. flock is released by the kernel when the holder dies (kill -9
        included), so a stale lock file never locks a directory out."""
        path = self.root / LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | _OPEN_SAFE, 0o600)
        except OSError as e:
            self.disable(f"cannot open the lock file {path}: {e}")
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            try:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            except OSError:
                holder = "?"
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                self.disable(f"cannot lock {path}: {e}")
                return
            self.disable(f"another process (pid {holder}) uses this directory as its disk "
                         "KV cache; one daemon per directory: give each its own "
                         "--disk-cache-dir")
            return
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError:
            pass  # the pid is only for the second daemon's message
        self._lock_fd = fd

    def close(self) -> None:
        """Release the directory's lock (the files stay)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the last fd of the open file releases the flock

    @property
    def ours(self) -> bool:
        return (self.root / MARKER).is_file()

    def disable(self, err: BaseException | str) -> None:
        """Stop using the tier (once, with one warning)."""
        with self._lock:
            if self.disabled:
                return
            self.disabled = True
            self.error = str(err)
        log.warning("disk KV tier at %s disabled: %s (serving continues without it)",
                    self.root, self.error)

    # ------------------------------------------------------------------ write
    def encode(self, h: int, parent: int, first: bool, tokens: Sequence[int],
               payload: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
        """The file's bytes, as pieces (header, tokens, payload pieces)."""
        if len(tokens) != self.block_size:
            raise ValueError(f"a block has {self.block_size} tokens, got {len(tokens)}")
        toks = struct.pack(f"<{len(tokens)}I", *tokens)
        size = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in payload)
        if size != self.payload_bytes:
            raise ValueError(f"payload is {size} bytes, the format says {self.payload_bytes}")
        head = HEADER.pack(MAGIC, FORMAT_VERSION, FLAG_FIRST if first else 0, self.fp,
                           h, parent, len(tokens), size, 0)[:_CRC_SPAN]
        crc = zlib.crc32(toks, zlib.crc32(head))
        for p in payload:
            crc = zlib.crc32(p, crc)
        return [head + struct.pack("<I", crc), toks, *payload]

    def write(self, h: int, parent: int, first: bool, tokens: Sequence[int],
              payload: Sequence[bytes | memoryview]) -> bool:
        """Write one block's file (temporary name, then rename); False when the store is
        disabled or the write failed (which disables it)."""
        if self.disabled:
            return False
        pieces = self.encode(h, parent, first, tokens, payload)
        name = file_name(h)
        tmp = self.root / f"{TMP_PREFIX}{os.getpid()}-{name}"
        try:
            # O_EXCL after the unlink: a name planted where our temporary file goes (a
            # FIFO would block the open, a symlink would redirect the write) is replaced
            tmp.unlink(missing_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _OPEN_SAFE, 0o600)
            try:
                for p in pieces:
                    view = memoryview(p).cast("B")
                    while view:
                        n = os.write(fd, view)
                        view = view[n:]
            finally:
                os.close(fd)
            os.replace(tmp, self.root / name)
        except OSError as e:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self.disable(e)
            return False
        self.written += 1
        self.bytes_written += self.file_bytes
        return True

    def remove(self, h: int) -> None:
        """Delete a block's file (LRU eviction); a missing file is fine."""
        if self.disabled:
            return
        try:
            (self.root / file_name(h)).unlink(missing_ok=True)
        except OSError as e:
            self.disable(e)

    # ------------------------------------------------------------------- read
    def buffer(self) -> mmap.mmap:
        """A read buffer: page-aligned (``O_DIRECT`` wants that) and longer than a file by
        at least a byte (a longer file is torn). Callers reuse them: a fresh one costs
        the kernel zeroing its pages."""
        return mmap.mmap(-1, -(-(self.file_bytes + 1) // ALIGN) * ALIGN)

    def read(self, h: int, parent: int, tokens: Sequence[int],
             buf: mmap.mmap | bytearray | None = None) -> memoryview | None:
        """The payload of block ``h`` (a view into ``buf``, or into a new buffer) if its
        file is intact and is exactly the block the caller expects (same parent hash and
        token ids); else None (and a file that fails verification is removed). Reads
        bypass the page cache (``O_DIRECT``) where the filesystem allows: one copy less,
        about half the CPU of a buffered read, and a read that comes from the disk."""
        if self.disabled:
            return None
        path = self.root / file_name(h)
        if buf is None:
            buf = self.buffer()
        try:
            n = self._read_file(path, buf)
        except (FileNotFoundError, NotRegularFile):
            return None  # gone, or not ours to read (a FIFO, a symlink): a miss
        except OSError as e:
            self.disable(e)
            return None
        data = memoryview(buf)[:n]
        got = self._verify(data)
        if got is None or got.hash != h:
            with self._lock:
                self.read_bad += 1
            self._drop(path)
            return None
        if got.parent != parent or got.tokens != tuple(tokens):
            return None  # another chain's block under a colliding hash: a miss
        with self._lock:
            self.read_ok += 1
            self.bytes_read += len(data)
        return data[HEADER.size + 4 * self.block_size:]

    def _read_file(self, path: Path, buf: mmap.mmap | bytearray) -> int:
        """Read the file at ``path`` into ``buf`` (up to its length); bytes read."""
        if self.direct and isinstance(buf, mmap.mmap):
            try:
                fd, _ = open_regular(path, os.O_RDONLY | os.O_DIRECT)
            except NotRegularFile:
                raise
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False  # this filesystem has no O_DIRECT (tmpfs)
            else:
                try:
                    # one call: a direct read is short only at the end of the file
                    return os.readv(fd, [buf])
                except OSError as e:
                    if e.errno != errno.EINVAL:
                        raise
                    self.direct = False  # the buffer or the device refused alignment
                finally:
                    os.close(fd)
        fd, _ = open_regular(path, os.O_RDONLY)
        try:
            view, got = memoryview(buf), 0
            while got < len(view):
                n = os.readv(fd, [view[got:]])
                if not n:
                    break
                got += n
            return got
        finally:
            os.close(fd)

    def _verify(self, data: bytes | memoryview, size: int | None = None) -> DiskEntry | None:
        """The entry a file's bytes describe, or None if they are not a whole, intact file
        of this fingerprint. ``size``: the file's size when ``data`` is only its head (the
        checksum is then left to the read)."""
        check_crc = size is None
        if (len(data) if check_crc else size) != self.file_bytes or \
                len(data) < HEADER.size + 4 * self.block_size:
            return None
        magic, version, flags, fp, h, parent, n, size, crc = HEADER.unpack_from(data)
        if (magic != MAGIC or version != FORMAT_VERSION or fp != self.fp
                or n != self.block_size or size != self.payload_bytes):
            return None
        if check_crc:
            body = memoryview(data)
            if zlib.crc32(body[HEADER.size:], zlib.crc32(body[:_CRC_SPAN])) != crc:
                return None
        tokens = struct.unpack_from(f"<{n}I", data, HEADER.size)
        return DiskEntry(h, parent, bool(flags & FLAG_FIRST), tokens, 0)

    def _drop(self, path: Path) -> None:
        if not self.ours:
            return
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass

    # ------------------------------------------------------------------- scan
    def scan(self, verify: bool = False) -> list[DiskEntry]:
        """The servable files, least recently written first. Reads each file's header and
        tokens (``verify``: the whole file and its checksum; otherwise the checksum is
        checked when the block is read). Temporary files, torn files and files of another
        fingerprint are skipped, and deleted when the directory is ours. Names that are
        not regular files (FIFOs, devices, sockets, symlinks) are never opened, adopted
        or deleted: they are skipped and counted in ``skipped_irregular``."""
        if self.disabled:
            return []
        ours = self.ours
        self.skipped_irregular = 0
        removed_before = self.removed_foreign
        found: list[DiskEntry] = []
        try:
            names = os.listdir(self.root)
        except OSError as e:
            self.disable(e)
            return []
        head_len = HEADER.size + 4 * self.block_size
        for name in names:
            if name in (MARKER, LOCK):
                continue
            if name.startswith(TMP_PREFIX) and _writer_alive(name):
                continue  # another live process is writing it: not ours to delete
            path = self.root / name
            entry = None
            try:
                lst = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISREG(lst.st_mode):
                if not stat.S_ISDIR(lst.st_mode):
                    self.skipped_irregular += 1
                continue
            if name.endswith(SUFFIX) and not name.startswith(TMP_PREFIX):
                try:
                    # lstat said regular; open_regular checks again (it may have changed)
                    fd, st = open_regular(path)
                    with open(fd, "rb", buffering=0) as f:
                        data = f.read() if verify else f.read(head_len)
                except OSError:
                    continue
                if st.st_size == self.file_bytes:
                    e = self._verify(data, None if verify else st.st_size)
                    if e is not None and file_name(e.hash) == name:
                        entry = DiskEntry(e.hash, e.parent, e.first, e.tokens,
                                          st.st_mtime_ns)
            if entry is None:
                if ours:
                    try:
                        path.unlink()
                        self.removed_foreign += 1
                    except OSError:
                        pass
                continue
            found.append(entry)
        found.sort(key=lambda e: (e.mtime_ns, e.hash))
        if self.removed_foreign > removed_before:
            log.warning("disk KV tier at %s: deleted %d files that were torn, of another "
                        "model or page format (fingerprint), or a dead writer's temporary "
                        "files", self.root, self.removed_foreign - removed_before)
        if self.skipped_irregular:
            log.warning("disk KV tier at %s: %d names are not regular files (FIFOs, "
                        "devices, symlinks): skipped, never opened or followed",
                        self.root, self.skipped_irregular)
        return found
