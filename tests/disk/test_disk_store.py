"""The disk tier's file format: what is written reads back; anything torn, truncated,
flipped, foreign or colliding is a miss, never bytes handed on; faults disable the store
with one warning."""

from __future__ import annotations

import errno
import logging
import os
import stat
import subprocess
import sys
import threading

import pytest

from kvscope.engine.runner import disk_store as D
from tests.waiting import HANG_S

BS = 4
FP = D.fingerprint("tiny-llama", "fp32", BS, [((BS, 2, 8), "float32")] * 4)
PAYLOAD = BS * 2 * 8 * 4 * 4


def store(root, fp=FP) -> D.DiskStore:
    return D.DiskStore(root, fp, BS, PAYLOAD)


def payload(seed: int) -> list[bytes]:
    return [bytes((seed + i + j) % 256 for j in range(PAYLOAD // 4)) for i in range(4)]


def test_roundtrip_and_scan(tmp_path):
    s = store(tmp_path / "kv")
    assert stat.S_IMODE(os.stat(tmp_path / "kv").st_mode) == 0o700
    assert s.write(11, 7, True, (1, 2, 3, 4), payload(0))
    assert s.write(-5, 11, False, (5, 6, 7, 8), payload(1))
    assert bytes(s.read(11, 7, (1, 2, 3, 4))) == b"".join(payload(0))
    assert bytes(s.read(-5, 11, (5, 6, 7, 8))) == b"".join(payload(1))
    # a fresh store over the same directory (a restart) finds both, oldest first
    os.utime(tmp_path / "kv" / D.file_name(11), ns=(1, 1))
    os.utime(tmp_path / "kv" / D.file_name(-5), ns=(2, 2))
    entries = store(tmp_path / "kv").scan(verify=True)
    assert [(e.hash, e.parent, e.first, e.tokens) for e in entries] == [
        (11, 7, True, (1, 2, 3, 4)), (-5, 11, False, (5, 6, 7, 8))]
    assert not any(n.startswith(D.TMP_PREFIX) for n in os.listdir(tmp_path / "kv"))


def test_colliding_hash_with_other_tokens_or_parent_is_a_miss(tmp_path):
    s = store(tmp_path)
    s.write(11, 7, True, (1, 2, 3, 4), payload(0))
    assert s.read(11, 7, (1, 2, 3, 5)) is None
    assert s.read(11, 8, (1, 2, 3, 4)) is None
    assert s.read(12, 7, (1, 2, 3, 4)) is None  # no such file
    assert s.read(11, 7, (1, 2, 3, 4)) is not None  # and the file is still served


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "flip_tokens",
                                    "truncate", "extend", "empty"])
def test_damaged_file_is_a_miss_and_removed(tmp_path, damage, direct):
    """Both read paths (O_DIRECT into an aligned buffer where the filesystem has it, and
    buffered) verify the same way."""
    s = store(tmp_path)
    s.direct = direct and s.direct
    assert s.write(11, 7, True, (1, 2, 3, 4), payload(0))
    assert bytes(s.read(11, 7, (1, 2, 3, 4))) == b"".join(payload(0))
    path = tmp_path / D.file_name(11)
    data = bytearray(path.read_bytes())
    if damage == "flip_payload":
        data[-3] ^= 0x10
    elif damage == "flip_header":
        data[30] ^= 0x01  # inside the parent hash
    elif damage == "flip_tokens":
        data[D.HEADER.size + 1] ^= 0x80
    elif damage == "truncate":
        data = data[:-1]
    elif damage == "extend":
        data += b"\0"
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    assert store(tmp_path).scan(verify=True) == []
    assert not path.exists()  # the directory is ours: removed
    s.write(11, 7, True, (1, 2, 3, 4), payload(0))
    path.write_bytes(bytes(data))
    if damage.startswith("flip") and damage != "flip_header":
        assert len(store(tmp_path).scan()) == 1  # the quick scan reads heads only
    assert s.read(11, 7, (1, 2, 3, 4)) is None
    assert s.read_bad == 1 and not path.exists()


def test_name_must_match_header_hash(tmp_path):
    s = store(tmp_path)
    s.write(11, 7, True, (1, 2, 3, 4), payload(0))
    os.rename(tmp_path / D.file_name(11), tmp_path / D.file_name(12))
    assert s.scan() == []
    assert s.read(12, 7, (1, 2, 3, 4)) is None


def test_foreign_fingerprint_removed_in_our_dir_kept_elsewhere(tmp_path):
    other = D.fingerprint("another-model", "fp32", BS, [((BS, 2, 8), "float32")] * 4)
    assert other != FP
    store(tmp_path / "ours", other).write(11, 7, True, (1, 2, 3, 4), payload(0))
    (tmp_path / "ours" / "notes.txt").write_text("stray")
    (tmp_path / "ours" / f"{D.TMP_PREFIX}99-{D.file_name(3)}").write_bytes(b"torn")
    s = store(tmp_path / "ours")
    assert s.read(11, 7, (1, 2, 3, 4)) is None
    assert s.scan() == []
    assert sorted(os.listdir(tmp_path / "ours")) == [D.MARKER]
    # a directory that is not ours (no marker, not empty): foreign files are left alone
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "data.bin").write_bytes(b"x")
    store(theirs, other).write(11, 7, True, (1, 2, 3, 4), payload(0))
    s = store(theirs)
    assert not s.ours and s.scan() == []
    assert sorted(os.listdir(theirs)) == sorted(["data.bin", D.file_name(11)])


def test_fingerprint_covers_every_part():
    base = ("m", "fp32", 4, [((4, 2, 8), "float32")])
    fps = {D.fingerprint(*base),
           D.fingerprint("m2", *base[1:]),
           D.fingerprint("m", "bf16", 4, base[3]),
           D.fingerprint("m", "fp32", 8, base[3]),
           D.fingerprint("m", "fp32", 4, [((4, 2, 16), "float32")]),
           D.fingerprint("m", "fp32", 4, [((4, 2, 8), "bfloat16")]),
           D.fingerprint("m", "fp32", 4, base[3] * 2)}
    assert len(fps) == 7


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS, errno.EIO])
def test_write_fault_disables_with_one_warning(tmp_path, monkeypatch, caplog, err):
    s = store(tmp_path)
    s.write(11, 7, True, (1, 2, 3, 4), payload(0))
    real_write = os.write

    def failing(fd, data):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, "write", failing)
    with caplog.at_level(logging.WARNING, logger=D.__name__):
        assert not s.write(12, 11, False, (5, 6, 7, 8), payload(1))
        assert not s.write(13, 12, False, (5, 6, 7, 8), payload(1))
    monkeypatch.setattr(os, "write", real_write)
    assert s.disabled and os.strerror(err) in s.error
    assert len([r for r in caplog.records if "disabled" in r.message]) == 1
    assert s.read(11, 7, (1, 2, 3, 4)) is None  # disabled: every read is a miss
    assert sorted(os.listdir(tmp_path)) == [D.MARKER, D.file_name(11)]  # no temp left


def test_unwritable_directory_disables_at_open(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger=D.__name__):
        s = store(blocker / "kv")
    assert s.disabled
    assert not s.write(11, 7, True, (1, 2, 3, 4), payload(0))
    assert s.scan() == [] and s.read(11, 7, (1, 2, 3, 4)) is None


def _in_thread(fn):
    """Run ``fn`` on a daemon thread; its result, or an AssertionError if it is still
    running after the hang guard (a FIFO open that waits for a writer never returns)."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(HANG_S)
    assert not t.is_alive(), "the disk store blocked on a name that is not a regular file"
    return out[0]


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_fifo_named_like_a_block_file_is_skipped_never_waited_on(tmp_path, direct, caplog):
    """Defect 4: a FIFO named like a block file hung the start-up scan (and a read) in
    open() forever. It is now skipped by the scan, a miss to a read, and left in place."""
    s = store(tmp_path)
    s.direct = direct and s.direct
    assert s.write(11, 7, True, (1, 2, 3, 4), payload(0))
    fifo = tmp_path / D.file_name(12)
    os.mkfifo(fifo)
    with caplog.at_level(logging.WARNING):
        entries = _in_thread(lambda: store(tmp_path).scan(verify=True))
    assert [e.hash for e in entries] == [11]
    assert "not regular files" in caplog.text
    assert _in_thread(lambda: s.read(12, 7, (1, 2, 3, 4))) is None
    assert not s.disabled and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    # a block file replaced by a FIFO at run time is a miss too, and the store serves on
    os.replace(fifo, tmp_path / D.file_name(11))
    assert _in_thread(lambda: s.read(11, 7, (1, 2, 3, 4))) is None
    assert not s.disabled


def test_symlinked_block_file_is_never_followed_or_adopted(tmp_path):
    """A block file that is a symlink (here to a valid block file outside the directory)
    was adopted and served; now it is neither, and its target is untouched."""
    outside = store(tmp_path / "outside")
    assert outside.write(11, 7, True, (1, 2, 3, 4), payload(0))
    target = tmp_path / "outside" / D.file_name(11)
    s = store(tmp_path / "kv")
    os.symlink(target, tmp_path / "kv" / D.file_name(11))
    assert s.scan() == [] and s.scan(verify=True) == []
    assert s.read(11, 7, (1, 2, 3, 4)) is None
    assert os.path.islink(tmp_path / "kv" / D.file_name(11)) and target.is_file()
    assert not s.disabled


def test_planted_temporary_name_does_not_block_or_redirect_a_write(tmp_path):
    """A FIFO or symlink where the next write's temporary file goes is replaced, not
    opened (a FIFO blocked the writer; a symlink redirected its bytes elsewhere)."""
    s = store(tmp_path / "kv")
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    os.symlink(victim, tmp_path / "kv" / f"{D.TMP_PREFIX}{os.getpid()}-{D.file_name(11)}")
    os.mkfifo(tmp_path / "kv" / f"{D.TMP_PREFIX}{os.getpid()}-{D.file_name(12)}")
    assert _in_thread(lambda: s.write(11, 7, True, (1, 2, 3, 4), payload(0)))
    assert _in_thread(lambda: s.write(12, 11, False, (5, 6, 7, 8), payload(1)))
    assert victim.read_bytes() == b"keep me"
    assert bytes(s.read(12, 11, (5, 6, 7, 8))) == b"".join(payload(1))


_HOLDER = """
import sys
from kvscope.engine.runner import disk_store as D
s = D.DiskStore(sys.argv[1], bytes(16), 4, 512, exclusive=True)
print("disabled" if s.disabled else "holding", flush=True)
sys.stdin.read()  # hold the directory until the test closes our stdin
"""


def test_second_daemon_on_a_directory_runs_without_the_tier_and_says_who(tmp_path, caplog):
    """Defect 6: two daemons on one directory broke each other (a scan deleted the other's
    in-flight files, a smaller size or another fingerprint deleted its blocks). The first
    one (another process) holds the directory's lock; the second is disabled before it
    scans, says which pid holds it, and deletes nothing; once the first stops, the
    directory is free again."""
    kv = tmp_path / "kv"
    first = subprocess.Popen([sys.executable, "-c", _HOLDER, str(kv)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "holding"
        # the first daemon's blocks and an in-flight write, under another fingerprint
        other = D.DiskStore(kv, bytes(16), BS, PAYLOAD)
        assert other.write(11, 7, True, (1, 2, 3, 4), payload(0))
        inflight = kv / f"{D.TMP_PREFIX}{first.pid}-{D.file_name(12)}"
        inflight.write_bytes(b"half a file")
        before = sorted(os.listdir(kv))
        with caplog.at_level(logging.WARNING):
            second = D.DiskStore(kv, FP, BS, PAYLOAD, exclusive=True)
        assert second.disabled and f"pid {first.pid}" in second.error
        assert "one daemon per directory" in caplog.text
        assert second.scan() == [] and not second.write(13, 7, True, (1, 2, 3, 4), payload(1))
        assert sorted(os.listdir(kv)) == before
    finally:
        first.stdin.close()
        first.wait()
    third = D.DiskStore(kv, FP, BS, PAYLOAD, exclusive=True)  # the holder is gone
    try:
        assert not third.disabled
    finally:
        third.close()


def test_scan_leaves_a_live_writers_temporary_file_alone(tmp_path):
    """A scan deleted every ``.tmp-<pid>-*`` file, another live process's in-flight write
    included (its rename then failed with ENOENT and disabled its tier). Now only this
    process's and dead processes' temporary files go."""
    s = store(tmp_path)
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        names = {p: f"{D.TMP_PREFIX}{p}-{D.file_name(11)}" for p in
                 (live.pid, dead.pid, os.getpid())}
        for n in names.values():
            (tmp_path / n).write_bytes(b"partial")
        assert store(tmp_path).scan() == []
        assert sorted(os.listdir(tmp_path)) == sorted([D.MARKER, names[live.pid]])
    finally:
        live.stdin.close()
        live.wait()
    assert not s.disabled
