"""A bookkeeping-only stand-in for the runner's disk side: it takes a manager's swap
rounds, remembers which blocks each SAVE wrote (by hash, as files are named), and
reports writes and reads back the way engine.runner.disk_io does: in order, a step later.
``fail_writes`` / ``bad_files``: hashes whose write fails / whose file reads as torn."""

from __future__ import annotations

from typing import Any

from kvscope.engine.cache.transfers import DROP, FILL, LOAD, SAVE, DiskBatch


class FakeDisk:
    def __init__(self) -> None:
        self.files: dict[int, tuple[int, tuple[int, ...]]] = {}  # hash -> (parent, tokens)
        self.saved: list[tuple[int, int, bool]] = []
        self.loads: list[tuple[int, int]] = []  # (disk block, hash)
        self.fills: list[tuple[int, int]] = []  # (disk block, host block) ever filled
        self.fail_writes: set[int] = set()
        self.bad_files: set[int] = set()

    def run(self, m: Any) -> list:
        """Take and 'perform' the step's rounds; returns them."""
        rounds = m.take_swap_rounds()
        for r in rounds:
            if not isinstance(r, DiskBatch):
                continue
            for op in r:
                if op.kind == SAVE:
                    ok = op.hash not in self.fail_writes
                    if ok:
                        self.files[op.hash] = (op.parent, op.tokens)
                    self.saved.append((op.slot, op.hash, ok))
                elif op.kind == DROP:
                    self.files.pop(op.hash, None)
                elif op.kind == LOAD:
                    self.loads.append((op.slot, op.hash))
                elif op.kind == FILL:
                    self.fills.append((op.slot, op.host))
        return rounds

    def report(self, m: Any) -> None:
        """Hand the outcomes of the ops performed so far to the manager."""
        loaded = [(s, h in self.files and h not in self.bad_files) for s, h in self.loads]
        m.disk_results(self.saved, loaded)
        self.saved, self.loads = [], []

    def found(self) -> list[tuple[int, int, bool, tuple[int, ...]]]:
        """What a scan of the directory would find (a restart)."""
        return [(h, p, False, t) for h, (p, t) in self.files.items()]


def scenario_steps(sink: Any) -> list[list[dict]]:
    """Every disk event kind from a real manager: a prefix spilled to disk (disk_store,
    evict on tier disk), prefetched back (prefetch, disk_load), hit."""
    from kvscope.engine.cache import KVCacheManager

    m = KVCacheManager(4, 4, num_cpu_blocks=4, num_disk_blocks=8, sink=sink)
    disk, steps = FakeDisk(), [sink.drain()]

    def run(sid: str, prompt: list[int]) -> None:
        m.add_sequence(sid, prompt)
        hit = m.match_prefix(sid)
        m.allocate_slots(sid, len(prompt) - hit)
        m.start(sid)
        m.finish(sid, "stop")
        disk.run(m)
        disk.report(m)
        m.flush_step_events()
        steps.append(sink.drain())

    prompt = list(range(1, 14))
    run("a", prompt)
    for i in range(4):
        run(f"f{i}", [100 * (i + 1) + j for j in range(13)])
    m.add_sequence("b", prompt)
    m.prefetch("b")
    steps.append(sink.drain())
    disk.run(m)
    disk.report(m)
    m.match_prefix("b")
    m.flush_step_events()
    steps.append(sink.drain())
    return steps


def dead_pid() -> int:
    """A pid no process can have (Linux allocates pids below pid_max): the pid of a writer
    that is certainly gone, for its temporary files."""
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read())
