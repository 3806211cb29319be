"""``kill -9`` of a process writing disk-tier files: the restarted store opens, serves every
file that was completed, drops the torn rest, and never serves other bytes.

The child writes blocks through engine.runner.disk_store.DiskStore. In the first test it
reports each completed file, then starts one more and stops halfway through its bytes
(its ``os.write`` is cut after the first piece), so the SIGKILL lands mid-write every
time; in the second it writes without pause and is killed wherever it happens to be.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from kvscope.engine.runner import disk_store as D

BS = 16
FP = D.fingerprint("tiny-llama", "fp32", BS, [((BS, 4, 64), "float32")] * 2)
PAYLOAD = BS * 4 * 64 * 4 * 2  # 32 KiB a block

CHILD = r"""
import os, sys, time
from kvscope.engine.runner import disk_store as D
root, mode = sys.argv[1], sys.argv[5]
bs, payload, fp = int(sys.argv[2]), int(sys.argv[3]), bytes.fromhex(sys.argv[4])
s = D.DiskStore(root, fp, bs, payload)

def block(h):
    half = payload // 2
    return (h - 1, tuple(range(h, h + bs)),
            [bytes([(h + i) % 251]) * half for i in range(2)])

h = 1
if mode == "paused":
    for h in range(1, 6):
        parent, tokens, pl = block(h)
        assert s.write(h, parent, h == 1, tokens, pl)
        print("done", h, flush=True)
    real = os.write
    count = [0]
    def cut(fd, data):
        count[0] += 1
        if count[0] > 1:  # the header went out; stop inside the file's bytes
            print("mid", 6, flush=True)
            time.sleep(600)
        return real(fd, data)
    os.write = cut
    parent, tokens, pl = block(6)
    s.write(6, parent, False, tokens, pl)
else:
    while True:
        parent, tokens, pl = block(h)
        s.write(h, parent, h == 1, tokens, pl)
        print("done", h, flush=True)
        h += 1
"""


def expected(h: int) -> tuple[int, tuple[int, ...], bytes]:
    half = PAYLOAD // 2
    return h - 1, tuple(range(h, h + BS)), b"".join(bytes([(h + i) % 251]) * half
                                                     for i in range(2))


def start(root: Path, mode: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path.cwd()), *sys.path]))
    return subprocess.Popen([sys.executable, "-c", CHILD, str(root), str(BS), str(PAYLOAD),
                             FP.hex(), mode], stdout=subprocess.PIPE, text=True, env=env)


def kill_after(p: subprocess.Popen, line: str) -> list[str]:
    """Read the child's lines until ``line`` starts one, SIGKILL it, and return every
    line it printed (those still in the pipe too)."""
    seen = []
    try:
        for got in p.stdout:  # the pipe closes if the child dies: no hang
            seen.append(got.strip())
            if got.startswith(line):
                break
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=60)
    seen += [got.strip() for got in p.stdout]
    assert p.returncode == -signal.SIGKILL, seen
    return seen


def restarted(root: Path) -> tuple[D.DiskStore, dict[int, D.DiskEntry]]:
    s = D.DiskStore(root, FP, BS, PAYLOAD)
    return s, {e.hash: e for e in s.scan(verify=True)}


def check_served(s: D.DiskStore, found: dict[int, D.DiskEntry]) -> None:
    for h, e in found.items():
        parent, tokens, data = expected(h)
        assert (e.parent, e.tokens) == (parent, tokens)
        got = s.read(h, parent, tokens)
        assert got is not None and bytes(got) == data


def test_kill_mid_write_serves_the_completed_files_and_drops_the_torn_one(tmp_path):
    root = tmp_path / "kv"
    seen = kill_after(start(root, "paused"), "mid")
    assert seen == [f"done {h}" for h in range(1, 6)] + ["mid 6"]
    torn = [n for n in os.listdir(root) if n.startswith(D.TMP_PREFIX)]
    assert len(torn) == 1 and 0 < (root / torn[0]).stat().st_size < D.file_bytes(BS, PAYLOAD)
    s, found = restarted(root)
    assert sorted(found) == [1, 2, 3, 4, 5]
    check_served(s, found)
    parent, tokens, _ = expected(6)
    assert s.read(6, parent, tokens) is None
    assert sorted(os.listdir(root)) == sorted([D.MARKER] + [D.file_name(h) for h in found])


def test_kill_at_a_random_moment_never_serves_garbage(tmp_path):
    root = tmp_path / "kv"
    seen = kill_after(start(root, "loop"), "done 40")
    completed = {int(x.split()[1]) for x in seen}
    s, found = restarted(root)
    assert completed <= set(found)  # every reported file survives
    assert set(found) <= completed | {max(completed) + 1}  # at most one unreported
    check_served(s, found)
    assert not any(n.startswith(D.TMP_PREFIX) for n in os.listdir(root))
