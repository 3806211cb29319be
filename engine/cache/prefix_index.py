"""PrefixIndex: matching a sequence's prefix against the cache, and indexing full blocks.

The prefix cache's two operations over the pools of ``CacheTiers`` (tiers.py), on the
``CacheSeq`` records the manager hands in:

- ``match(seq)``: share the longest verified cached prefix of an empty-tabled sequence
  (up to all but its last token), from the gpu index, continuing into the host index when
  the host tier writes back (host blocks are loaded into fresh gpu blocks: ``host_hit``),
  shortened to what the window group can serve when there is one.
- ``store(seq)``: index the sequence's newly full blocks whose token ids are known.

Invariants:
- An entry is (hash, parent_id, tokens, serial, parent hash); a hash is the CPython hash
  of (parent hash, tokens), chained from ``seq.root_hash`` (engine.cache.hashing). A hit
  is verified by exact parent serial and tokens, so a collision is a miss, never a wrong
  hit, and no block after an unproven one is indexed (``chain_id`` None).
- A serial names a content: a gpu block storing a content the host still holds reuses
  the host entry (host_tier), so a chain spread over both tiers stays verifiable.
- After ``match``/``store``, ``seq.num_stored`` blocks have been offered to the index and
  ``seq.chain_hash``/``seq.chain_id`` name the last of them.
The query and hit counters, and the step's moved-token bookkeeping, stay the manager's.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

from kvscope.engine.cache.sequence import CacheSeq
from kvscope.engine.cache.tiers import CacheTiers
from kvscope.engine.events import causes as C
from kvscope.engine.events import schema as S
from kvscope.engine.events.sink import EventSink


class PrefixIndex:
    def __init__(self, tiers: CacheTiers, sink: EventSink) -> None:
        self.tiers = tiers
        self.sink = sink  # the manager's; replaced with it (KVCacheManager.sink)
        self.block_size = tiers.block_size
        self.gpu = tiers.gpu
        self.host = tiers.host
        self.window = tiers.window

    def match(self, seq: CacheSeq) -> int:
        """Share the longest verified cached prefix into the empty table of ``seq``;
        return the tokens it covers (a multiple of the block size; 0: no hit)."""
        if self.host is not None and self.window is None:  # no host hits beside a window
            return self._match_both_tiers(seq)
        bs, toks, pool = self.block_size, seq.token_ids, self.gpu
        cached, entry = pool.cached, pool.entry
        blocks: list[int] = []
        ph, pid = seq.root_hash, seq.root_id
        # Lazily cut the matchable span (all but the last token) into bs-tuples.
        for chunk in zip(*[islice(toks, (len(toks) - 1) // bs * bs)] * bs, strict=True):
            h = hash((ph, chunk))
            b = cached.get(h)
            if b is None:
                break
            e = entry[b]
            if e[1] != pid or e[2] != chunk:  # a hash collision, not this prefix
                break
            blocks.append(b)
            pid = e[3]
            ph = h
        window_hit: list[int] = []
        if self.window is not None and blocks:
            # a hit also needs the window group's blocks of its last W tokens: the longest
            # prefix of the group-0 hit that has them (engine.cache.window_group)
            chain = [entry[b][::3] for b in blocks]  # (hash, serial) per block
            k, window_hit = self.window.longest_hit(chain)
            del blocks[k:]
            if blocks:
                ph, pid = chain[k - 1]
        num_hit = len(blocks) * bs
        if blocks:
            seq_id = seq.seq_id
            pool.share(blocks, seq.priority)
            seq.block_table = blocks
            seq.num_tokens = num_hit
            seq.num_stored = len(blocks)
            seq.chain_hash, seq.chain_id = ph, pid
            if self.sink.enabled:
                self.sink.block_op(S.HIT, "gpu", seq_id, blocks, num_hit)
            if self.window is not None:
                self.window.take_hit(seq, len(blocks), window_hit)
                if window_hit and self.sink.enabled:
                    self.sink.emit(S.HIT, tier="gpu", seq=seq_id, blocks=list(window_hit),
                                   group=1)
        return num_hit

    def _match_both_tiers(self, seq: CacheSeq) -> int:
        """``match`` over the gpu index, then the host index, block by block."""
        self.tiers.asking(seq.seq_id, C.R_HOST_HIT)
        bs, toks, gpu, host = self.block_size, seq.token_ids, self.gpu, self.host.host
        found: list[tuple[bool, int]] = []  # (on the host?, block), in table order
        ph, pid = seq.root_hash, seq.root_id
        for chunk in zip(*[islice(toks, (len(toks) - 1) // bs * bs)] * bs, strict=True):
            h = hash((ph, chunk))
            b = gpu.cached.get(h)
            if b is not None:
                e = gpu.entry[b]
                if e[1] != pid or e[2] != chunk:  # a collision: the host copy could not be
                    break  # indexed on the gpu under this hash either
                found.append((False, b))
            else:
                y = host.cached.get(h)
                if y is None:
                    break
                e = host.entry[y]
                if e[1] != pid or e[2] != chunk:
                    break
                found.append((True, y))
            pid = e[3]
            ph = h
        # Loading host blocks takes gpu blocks: keep the prefix that fits.
        room = gpu.num_free_blocks - sum(1 for on_host, b in found
                                         if not on_host and gpu.ref[b] == 0)
        for i, (on_host, _) in enumerate(found):
            if on_host:
                room -= 1
                if room < 0:
                    del found[i:]
                    break
        if not found:
            return 0
        on_gpu = [b for on_host, b in found if not on_host]
        if on_gpu:  # revive first: loading the host blocks may evict cached gpu blocks
            gpu.share(on_gpu, seq.priority)
        loaded = iter(self.host.load([b for on_host, b in found if on_host], seq.priority))
        table = []
        runs: list[tuple[bool, list[int], list[int]]] = []  # (host?, src, table blocks)
        for on_host, b in found:
            x = next(loaded) if on_host else b
            table.append(x)
            if not runs or runs[-1][0] != on_host:
                runs.append((on_host, [], []))
            runs[-1][1].append(b)
            runs[-1][2].append(x)
        num_hit = len(table) * bs
        last = gpu.entry[table[-1]]
        seq.block_table = table
        seq.tier = "gpu"
        seq.num_tokens = num_hit
        seq.num_stored = len(table)
        seq.chain_hash, seq.chain_id = last[0], last[3]
        if self.sink.enabled:
            for on_host, src, dst in runs:
                if on_host:
                    self.sink.emit(S.HOST_HIT, seq=seq.seq_id, src=src, dst=dst,
                                   tokens=len(dst) * bs)
                else:
                    self.sink.block_op(S.HIT, "gpu", seq.seq_id, dst, len(dst) * bs)
        return num_hit

    def store(self, seq: CacheSeq) -> None:
        """Index the sequence's newly full blocks whose token ids are known."""
        bs = self.block_size
        full = min(seq.num_tokens, len(seq.token_ids)) // bs
        first = seq.num_stored
        if first >= full or seq.tier != "gpu":  # swapped: stored when it is swapped in
            return
        pool = self.gpu
        cached, entry, serial = pool.cached, pool.entry, pool.num_stored
        host = self.host.host.cached if self.host is not None else None
        ph, pid = seq.chain_hash, seq.chain_id
        stored = []
        # vLLM's BlockStored needs each stored block's parent hash and tokens (sink.py)
        detail = self.sink.enabled and getattr(self.sink, "store_detail", False)
        parents: list[int | None] = []
        first_block = seq.block_table[0] if seq.block_table else None
        # zip(*[it] * bs) cuts the token span into bs-tuples at C speed.
        chunks = zip(*[iter(seq.token_ids[first * bs:full * bs])] * bs, strict=True)
        prompt_blocks = seq.num_prompt_tokens // bs
        # the window group indexes its blocks of the same contents (window_group.store)
        win: list[tuple[int, Any]] | None = [] if self.window is not None else None
        for i, (b, chunk) in enumerate(zip(seq.block_table[first:full], chunks, strict=True),
                                       first):
            ppid = pid
            h = hash((ph, chunk))
            e = entry[b]
            if e is not None:  # indexed already (shared with a sequence that got there first)
                pid = e[3]
            elif pid is not None:
                other = cached.get(h)
                if other is None:
                    # A content the host still holds keeps its serial (host_tier docstring).
                    y = host.get(h) if host else None
                    he = self.host.host.entry[y] if y is not None else None
                    if he is not None and he[1] == pid and he[2] == chunk:
                        entry[b] = he
                        pid = he[3]
                    else:
                        serial += 1
                        entry[b] = (h, pid, chunk, serial, ph)
                        pid = serial
                    cached[h] = b
                    stored.append(b)
                    if i < prompt_blocks:
                        seq.prompt_written += bs
                    if detail:
                        parents.append(None if b == first_block else ph)
                else:  # the same content under another block stays the indexed one
                    oe = entry[other]
                    pid = oe[3] if oe[1] == pid and oe[2] == chunk else None
            if win is not None and pid is not None:
                win.append((i, (h, ppid, chunk, pid, ph)))
            ph = h
        seq.num_stored = full
        seq.chain_hash, seq.chain_id = ph, pid
        pool.num_stored = serial
        if stored:
            pool.evictable.touch(stored, seq.priority)
            if detail:
                self.sink.emit(S.STORE, tier="gpu", blocks=stored,
                               hashes=[entry[b][0] for b in stored], **{
                                   S.STORE_PARENTS: parents,
                                   S.STORE_TOKENS: [entry[b][2] for b in stored]})
            elif self.sink.enabled:
                self.sink.store("gpu", stored, [entry[b][0] for b in stored])
        if win:
            wstored = self.window.store(seq, win)
            if wstored and self.sink.enabled:
                wentry = self.window.pool.entry
                self.sink.emit(S.STORE, tier="gpu", group=1, blocks=wstored,
                               hashes=[wentry[b][0] for b in wstored])
