"""DiskTier: the "disk" pool, a third tier below the host, and prefetch (pure bookkeeping).

The disk pool is a BlockPool whose block ids are slots of the disk index (one file per
slot, engine.runner.disk_store); every disk block is free or cached (ref stays 0). Its
entries are the host entries that were written there, extended by what a file keeps:
(hash, parent_id, tokens, serial, parent_hash). Blocks move like this, each move queued
as a ``DiskOp`` in the host tier's order list, so it keeps its place among the swap
orders (engine.cache.transfers):

- store (``write_back``, the host pool's eviction hook): a cached host block that is
  evicted is written to a disk block (event ``disk_store``, op SAVE) unless the disk
  holds its hash already; the disk evicts in LRU order when full (``evict`` tier disk,
  op DROP deletes the file). A write reported failed or dropped (``saved``) un-indexes
  its block (``evict`` tier disk, reason "disk_failed"); until a write is confirmed its
  block is ``pending`` and no prefetch reads it.
- prefetch (``prefetch``): a waiting sequence whose prefix continues on disk past the
  gpu and host indexes starts reads of those blocks (event ``prefetch``, op LOAD);
  they are pinned (out of the eviction order) until they arrive.
- arrive (``arrived``): verified reads take host blocks and become host prefix cache
  (event ``disk_load``, op FILL), under their original cache entry when it came
  from this process (its serial keeps the chain's children valid) or under a fresh entry
  whose parent is resolved now (blocks adopted from a previous run). A failed read is a
  miss and un-indexes its block. The sequence's next ``match_prefix`` then finds the
  blocks on the host (``host_hit``).

A disk hit is verified by the parent's chained hash and the exact token ids (a restart
loses the serials that verify hits in memory); the salt root is a keyed blake2b, so
tenants with different salts never share files.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import islice
from typing import TYPE_CHECKING, Any

from kvscope.engine.cache.block_pool import BlockPool, Entry
from kvscope.engine.cache.hashing import root_hash
from kvscope.engine.cache.transfers import DROP, FILL, LOAD, SAVE, DiskOp
from kvscope.engine.events import causes as C
from kvscope.engine.events import schema as S
from kvscope.engine.events.sink import EventSink

if TYPE_CHECKING:
    from kvscope.engine.cache.host_tier import HostTier
    from kvscope.engine.cache.sequence import CacheSeq

ADOPTED = ("adopted",)  # parent_id of a block found on disk at start-up (not a serial)


@dataclass
class Prefetch:
    """One waiting sequence's reads in flight (disk blocks, in chain order)."""

    seq_id: str
    root_id: Any  # the sequence's root parent identity: an adopted first block's parent
    outstanding: set[int] = field(default_factory=set)


class DiskTier:
    def __init__(self, gpu: BlockPool, host_tier: HostTier, disk: BlockPool,
                 sink: EventSink) -> None:
        self.gpu, self.host_tier, self.host, self.disk = gpu, host_tier, host_tier.host, disk
        self.sink = sink
        self.host.writeback = self.write_back
        disk.writeback = self._dropped
        self.pending: set[int] = set()  # disk blocks whose file is not confirmed yet
        self.inflight: dict[int, str] = {}  # disk block -> sequence whose prefetch reads it
        self.prefetches: dict[str, Prefetch] = {}
        self.enabled = True
        # counters (report.metrics)
        self.stored_blocks = 0
        self.write_failures = 0  # failed or dropped writes (un-indexed)
        self.prefetched_blocks = 0  # reads started
        self.arrived_blocks = 0  # reads that arrived intact and became host cache
        self.read_misses = 0
        self.prefetch_timeouts = 0  # sequences that stopped waiting and recomputed

    # ------------------------------------------------------------- storing
    def write_back(self, victims: list[int], entries: list[Entry]) -> None:
        """The host pool evicted ``victims`` (cached, ref 0): write those whose hash the
        disk does not hold yet to disk blocks."""
        if not self.enabled:
            return
        disk = self.disk
        todo = [(y, e) for y, e in zip(victims, entries, strict=True)
                if e[0] not in disk.cached and len(e) > 4]
        todo = todo[:disk.num_free_blocks]
        if not todo:
            return
        dst = disk.take(len(todo))  # may evict disk blocks (event evict, tier disk)
        for (y, e), s in zip(todo, dst, strict=True):
            disk.entry[s] = e
            disk.cached[e[0]] = s
            self.pending.add(s)
            self.host_tier.orders.append(DiskOp(SAVE, s, e[0], host=y, parent=e[4],
                                      first=e[1] is not ADOPTED and isinstance(e[1], tuple),
                                      tokens=e[2]))
        disk.evictable.push(dst)
        self.stored_blocks += len(dst)
        if self.sink.enabled:
            self.sink.emit(S.DISK_STORE, src=[y for y, _ in todo], dst=dst,
                           hashes=[e[0] for _, e in todo])

    def save_all(self) -> int:
        """A graceful stop: write every host-cached block the disk does not hold yet
        (after the gpu's cached blocks were written back to the host); returns how many
        (event ``disk_store``; the host keeps its copies)."""
        if not self.enabled:
            return 0
        host = self.host
        todo = [y for y in range(host.num_blocks) if host.entry[y] is not None
                and host.entry[y][0] not in self.disk.cached and len(host.entry[y]) > 4]
        n = 0
        while todo:  # a disk smaller than the host keeps the most recent ones
            part, todo = todo[:self.disk.num_free_blocks], todo[self.disk.num_free_blocks:]
            if not part:
                break
            self.write_back(part, [host.entry[y] for y in part])
            n += len(part)
        return n

    def _dropped(self, victims: list[int], entries: list[Entry]) -> None:
        """The disk pool evicted ``victims``: their files go."""
        for s, e in zip(victims, entries, strict=True):
            self.pending.discard(s)
            self.host_tier.orders.append(DiskOp(DROP, s, e[0]))

    def adopt(self, found: list[tuple[int, int, bool, tuple[int, ...]]]) -> int:
        """Index blocks found on disk at start-up, (hash, parent hash, first?, tokens),
        least recently written first, as many as the disk pool holds (the most recent);
        returns how many (event ``store`` on tier disk). Their files are the ones the
        runner scanned; those left out are dropped."""
        disk = self.disk
        fresh = [f for f in found if f[0] not in disk.cached]
        n = min(len(fresh), disk.num_free_blocks)
        keep = fresh[len(fresh) - n:]
        for h, _, _, _ in fresh[:len(fresh) - n]:
            self.host_tier.orders.append(DiskOp(DROP, -1, h))
        if not keep:
            return 0
        slots = disk.take(len(keep))
        for (h, parent, _first, tokens), s in zip(keep, slots, strict=True):
            disk.entry[s] = (h, ADOPTED, tuple(tokens), 0, parent)
            disk.cached[h] = s
        disk.evictable.push(slots)
        if self.sink.enabled:
            more = {}
            if getattr(self.sink, "store_detail", False):  # a vLLM-format publisher listens
                more = {S.STORE_PARENTS: [None if first else parent
                                          for _, parent, first, _ in keep],
                        S.STORE_TOKENS: [list(tokens) for _, _, _, tokens in keep]}
            self.sink.emit(S.STORE, tier="disk", blocks=slots, hashes=[f[0] for f in keep],
                           **more)
        return len(keep)

    def saved(self, results: list[tuple[int, int, bool]]) -> None:
        """The writer's outcomes, (disk block, hash, written?): a confirmed block becomes
        readable, a failed or dropped one leaves the index."""
        failed = []
        for s, h, ok in results:
            e = self.disk.entry[s] if 0 <= s < self.disk.num_blocks else None
            if e is None or e[0] != h or s not in self.pending:
                continue  # evicted (and maybe reused) meanwhile
            self.pending.discard(s)
            if not ok:
                failed.append(s)
        if failed:
            self.write_failures += len(failed)
            self._unindex(failed, C.R_DISK_FAILED)

    def _unindex(self, blocks: list[int], reason: str) -> None:
        disk = self.disk
        idle = [s for s in blocks if s not in self.inflight]
        disk.evictable.remove(idle)
        for s in idle:
            del disk.cached[disk.entry[s][0]]
            disk.entry[s] = None
            self.pending.discard(s)
        disk.free_blocks.extend(reversed(sorted(idle)))
        if idle and self.sink.enabled:
            self.sink.emit(S.EVICT, tier="disk", blocks=sorted(idle),
                           cause={C.POLICY: disk.evictable.name, C.REASON: reason,
                                  C.FREE_BLOCKS: len(disk.free_blocks) - len(idle)})

    def disable(self) -> None:
        """The store failed for good: forget every disk block not being read."""
        self.enabled = False
        self.pending.clear()
        idle = [s for s in range(self.disk.num_blocks)
                if self.disk.entry[s] is not None and s not in self.inflight]
        if idle:
            self._unindex(idle, C.R_DISK_FAILED)

    # ------------------------------------------------------------ prefetch
    def prefetch(self, seq: CacheSeq, bs: int) -> bool:
        """Start reading the disk blocks that continue ``seq``'s cached prefix (past the
        gpu and host indexes); True while the sequence has reads in flight (it should
        wait for them, a bounded time)."""
        pf = self.prefetches.get(seq.seq_id)
        if pf is not None:
            if pf.outstanding:
                return True
            del self.prefetches[seq.seq_id]
            return False
        if not self.enabled:
            return False
        gpu, host, disk = self.gpu, self.host, self.disk
        toks = seq.token_ids
        want: list[int] = []
        ph, pid = seq.root_hash, seq.root_id
        room = host.num_free_blocks
        for chunk in zip(*[islice(toks, (len(toks) - 1) // bs * bs)] * bs, strict=True):
            h = hash((ph, chunk))
            e = None
            for pool in (gpu, host):
                b = pool.cached.get(h)
                if b is not None and pool.entry[b][1] == pid and pool.entry[b][2] == chunk:
                    e = pool.entry[b]
                    break
            if e is None:
                s = disk.cached.get(h)
                if s is None or s in self.pending or s in self.inflight \
                        or len(want) >= room:
                    break
                e = disk.entry[s]
                if e[4] != ph or e[2] != chunk:
                    break
                want.append(s)
            pid = e[3] if e[1] is not ADOPTED else ADOPTED
            ph = h
        if not want:
            return False
        disk.evictable.remove(want)  # pinned until they arrive
        for s in want:
            self.inflight[s] = seq.seq_id
            e = disk.entry[s]
            self.host_tier.orders.append(DiskOp(LOAD, s, e[0], parent=e[4], tokens=e[2]))
        self.prefetches[seq.seq_id] = Prefetch(seq.seq_id, seq.root_id, set(want))
        self.prefetched_blocks += len(want)
        if self.sink.enabled:
            self.sink.emit(S.PREFETCH, seq=seq.seq_id, src=list(want))
        return True

    def give_up(self, seq_id: str, timed_out: bool = True) -> None:
        """The sequence stops waiting (it recomputes what has not arrived; what arrives
        later still becomes host cache). ``timed_out`` False: it left (finished)."""
        pf = self.prefetches.pop(seq_id, None)
        if pf is not None and pf.outstanding and timed_out:
            self.prefetch_timeouts += 1

    def arrived(self, results: list[tuple[int, bool]]) -> None:
        """The reader's outcomes, (disk block, intact?), in the order the reads were
        started: intact ones become host prefix cache (op FILL copies their bytes)."""
        disk, host, gpu = self.disk, self.host, self.gpu
        by_seq: dict[str, list[tuple[int, bool]]] = {}
        for s, ok in results:
            sid = self.inflight.pop(s, None)
            if sid is not None:
                by_seq.setdefault(sid, []).append((s, ok))
        for sid, got in by_seq.items():
            pf = self.prefetches.get(sid)
            if pf is not None:
                pf.outstanding.difference_update(s for s, _ in got)
            missed = [s for s, ok in got if not ok]
            todo = [s for s, ok in got if ok and disk.entry[s][0] not in host.cached
                    and disk.entry[s][0] not in gpu.cached]
            todo = todo[:host.num_free_blocks]
            src: list[int] = []
            dst: list[int] = []
            if todo:
                taken = host.take(len(todo))  # may evict host blocks: written to disk
                for s in todo:
                    e = self._host_entry(disk.entry[s], pf)
                    if e is None or e[0] in host.cached:
                        continue
                    y = taken[len(dst)]
                    host.entry[y] = e
                    host.cached[e[0]] = y
                    self.host_tier.orders.append(DiskOp(FILL, s, e[0], host=y))
                    src.append(s)
                    dst.append(y)
                host.free_blocks.extend(reversed(taken[len(dst):]))
                if dst:
                    host.evictable.push(dst)
            back = [s for s, ok in got if ok]
            if back:
                disk.evictable.push(back)  # unpinned, most recently used
            self.arrived_blocks += len(dst)
            self.read_misses += len(missed)
            if self.sink.enabled:
                more = {"missed": len(missed)} if missed else {}
                self.sink.emit(S.DISK_LOAD, seq=sid, src=src, dst=dst, **more)
            if missed:
                disk.evictable.push(missed)
                self._unindex(missed, C.R_DISK_FAILED)

    def _host_entry(self, e: Entry, pf: Prefetch | None) -> Entry | None:
        """The host entry of an arrived disk block: its own entry when it came from this
        process; for an adopted block, a fresh one whose parent is the entry now indexed
        under its parent hash (or the waiting sequence's root), None if there is none."""
        if e[1] is not ADOPTED:
            return e
        h, _, tokens, _, parent = e
        pid = None
        for pool in (self.gpu, self.host):
            b = pool.cached.get(parent)
            if b is not None:
                pid = pool.entry[b][3]
                break
        if pid is None and pf is not None and root_hash(pf.root_id[0]) == parent:
            pid = pf.root_id
        if pid is None:
            return None
        self.gpu.num_stored += 1  # serials are the gpu pool's
        return (h, pid, tokens, self.gpu.num_stored, parent)
