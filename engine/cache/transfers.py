"""Swap orders between the tiers, and how to batch them without changing their meaning.

The cache manager queues one order per block copy, in the order its decisions happen:
``("out", gpu_block, cpu_block)`` (swap-out, write-back of an evicted cached block) and
``("in", cpu_block, gpu_block)`` (swap-in, host prefix hit). Their meaning is sequential:
executed one by one, in order, they leave every block holding what the manager believes
it holds. The runner wants few big copies instead: ``plan_rounds`` groups the orders into
rounds, each one batched "out" copy (one gather + transfer + scatter per cache tensor)
followed by one batched "in" copy, and the rounds executed in order have exactly the
sequential effect. An ordinary step needs one round (its swap-outs and write-backs, then
its swap-ins and host hits); a new round starts only when an order would otherwise read
or write a block out of turn (for instance a host block that an earlier "in" of the same
step still has to read, then reused by a later "out").

With a disk tier (engine.cache.disk_tier) the same sequence also holds ``DiskOp``s: a
host block saved to a disk file, a disk read started, an arrived read filled into a host
block, a file dropped. They keep their place: ``plan_rounds`` closes the open round at
each run of disk ops and hands the run on as one ``DiskBatch``, which the runner performs
op by op, in order, between the rounds around it.
"""

from __future__ import annotations

from dataclasses import dataclass

OUT = "out"  # gpu -> cpu
IN = "in"  # cpu -> gpu
SAVE = "save"  # host block -> a new disk file (queued for the writer thread)
LOAD = "load"  # start reading a disk file (the reader thread; arrives later)
FILL = "fill"  # an arrived read -> host block
DROP = "drop"  # delete a disk file (it left the disk index)

Order = tuple[str, int, int]  # (direction, src block, dst block)
Round = tuple[list[tuple[int, int]], list[tuple[int, int]]]  # (out pairs, in pairs)


@dataclass(frozen=True, slots=True)
class DiskOp:
    """One disk order. ``host``: the host block SAVE reads or FILL writes (-1 for the
    others); ``slot``: the disk block; the rest names the file's block (for SAVE and LOAD,
    what the file must hold: parent hash, first-of-chain, token ids)."""

    kind: str
    slot: int
    hash: int
    host: int = -1
    parent: int = 0
    first: bool = False
    tokens: tuple[int, ...] = ()


class DiskBatch(list):
    """Disk ops to perform one by one, in order, between two rounds."""


def plan_rounds(orders: list[Order | DiskOp]) -> list[Round | DiskBatch]:
    """Rounds of (out pairs, in pairs) whose in-order execution, each round's out batch
    before its in batch, equals executing ``orders`` one by one.

    NOTE: within a round the "out" batch runs before every "in" of that round, even those
    queued earlier, so an "out" joins the open round only if it neither overwrites a host
    block an "in" of the round reads, nor reads a gpu block an "in" of the round writes;
    and no batch writes the same block twice (a batched scatter with repeated indices has
    no defined winner).
    """
    rounds: list[Round] = []
    outs: list[tuple[int, int]] = []
    ins: list[tuple[int, int]] = []
    out_dst: set[int] = set()  # host blocks the round's out batch writes
    in_src: set[int] = set()  # host blocks the round's in batch reads
    in_dst: set[int] = set()  # gpu blocks the round's in batch writes
    disk: DiskBatch | None = None
    for order in orders:
        if isinstance(order, DiskOp):
            if outs or ins:
                rounds.append((outs, ins))
                outs, ins, out_dst, in_src, in_dst = [], [], set(), set(), set()
            if disk is None:
                disk = DiskBatch()
                rounds.append(disk)
            disk.append(order)
            continue
        disk = None
        direction, src, dst = order
        if direction == OUT:
            if dst in in_src or src in in_dst or dst in out_dst:
                rounds.append((outs, ins))
                outs, ins, out_dst, in_src, in_dst = [], [], set(), set(), set()
            outs.append((src, dst))
            out_dst.add(dst)
        elif direction == IN:
            if dst in in_dst:
                rounds.append((outs, ins))
                outs, ins, out_dst, in_src, in_dst = [], [], set(), set(), set()
            ins.append((src, dst))
            in_src.add(src)
            in_dst.add(dst)
        else:
            raise ValueError(f"unknown swap direction {direction!r}")
    if outs or ins:
        rounds.append((outs, ins))
    return rounds
