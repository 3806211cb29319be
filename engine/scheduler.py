"""Continuous batching with chunked prefill and preemption (torch-free).

Each step has a token budget (``max_num_batched_tokens``) and a sequence cap
(``max_num_seqs``). Running sequences are served first, in admission order, each taking
``min(tokens left to compute, budget left)``: decodes take one token, unfinished prompts
take a chunk. Waiting sequences are admitted afterwards, by (priority, arrival), only
when the cache can hold their next chunk above the watermark, and not at all in a step
that had to preempt (admitting then would only thrash).

Prefill beside decodes (``max_prefill_tokens_with_decodes`` P > 0, chunked prefill on):
a step in which some running sequence decodes computes at most P prompt tokens, running
prefills first, then admissions, each prompt cut into even chunks (``_even_chunk``: 286
tokens under P = 128 go as 96, 95, 95, not 128, 128, 30: as many steps, but the longest
mixed step, which is the decodes' worst inter-token latency, a quarter shorter). A prompt
starts only with a whole chunk, and none starts after one that stays unfinished.
The cap grows with the queue: P more prompt tokens for every ``WAITING_PER_CAP`` requests
waiting (``_prefill_cap``), so that under a load that keeps many requests queued,
admissions keep pace with completions (a fixed P = 128 at 32 clients of 286-token prompts
admitted a sequence every third step and kept the decode batch at 21 of 32), and a queued
prompt goes in one step rather than two (each step that carries a chunk delays every
decode: fewer, whole-prompt steps leave most steps pure decodes). With one waiting, as
under a few clients, the cap stays P.
Arrivals then reach the batch in arrival order, a chunk a step, each step stalling the
running decodes for one short step instead of one long step that prefills every newcomer
at once. (That long step also ends their prefills together,
so the clients of a concurrency-limited load stay in lock step: each wave's first arrival
is prefilled alone on the idle engine and the rest wait for it, then for each other.) An
engine with nothing decoding takes the whole budget of prompts, as without P.

When a running sequence cannot get blocks, the scheduler preempts the running sequence
with the largest (priority, arrival) — lowest priority, latest arrival — among those not
yet scheduled in this step, which may be the sequence itself. (A sequence scheduled this
step holds slots whose K/V the step has not computed yet, and its full blocks are already
in the prefix index: preempting it would leave uncomputed blocks cached, or swap them out.)
Recompute mode frees the victim's blocks and puts it back in the waiting queue with its
generated tokens kept, so it resumes exactly where it stopped. Swap mode
(``preemption_mode="swap"``) moves its blocks to the cpu tier and parks it in the swapped
queue; when the host pool is too full the cache manager preempts it by recompute instead
(counted). Swapped sequences come back, by (priority, arrival), before any waiting
sequence is admitted, in steps that preempted nothing; their blocks are copied back before
the step's forward pass. A sequence that cannot fit even alone in an otherwise empty cache
finishes with reason "length" instead of looping forever.

Layouts: "paged" allocates blocks on demand; "contiguous" reserves ``max_model_len``
tokens of blocks at admission (the HF/FasterTransformer baseline, for comparison only).

The scheduler makes every cache call of a step, and the step flows one way through it:
``schedule()`` (demotion first, then the batch) hands the runner a ``SchedulerOutput``
that carries the step's block tables, slot mappings and tensor orders;
``update_from_output`` takes the sampled tokens back (computed tokens, appends,
finishes); ``end_step`` closes the step's event batch and reads the cache's figures for
the step stats.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any

from kvscope.engine.cache.slots import slot_mapping
from kvscope.engine.cache.transfers import DiskBatch, Round
from kvscope.engine.config import EngineConfig
from kvscope.engine.events import causes as C
from kvscope.engine.events.analysis.lifecycle import classify_chunk
from kvscope.engine.sequence import Sequence

# Every this many waiting requests raise the prefill cap beside decodes by one more P.
WAITING_PER_CAP = 2
# The first this many waiting sequences get their disk reads started (disk tier).
PREFETCH_AHEAD = 8


def _prefill_cap(cap: int, waiting: int, budget: int) -> int:
    """The prompt tokens a step beside decodes may compute: ``cap`` (P), plus P for every
    ``WAITING_PER_CAP`` requests waiting, at most the step's ``budget``."""
    return min(budget, cap * (1 + waiting // WAITING_PER_CAP))


def _even_chunk(tokens: int, cap: int) -> int:
    """The next chunk of a prompt with ``tokens`` left, cut beside decodes under a cap of
    ``cap`` prompt tokens a step: the first of ceil(tokens / cap) chunks of (almost) equal
    size. As many steps as cap-sized chunks and a remainder, never more than ``cap`` tokens
    in one, but no long chunk beside a short one: the longest mixed step is the running
    decodes' worst inter-token latency (286 tokens under 128: 96, 95, 95, not 128, 128, 30)."""
    chunks = -(-tokens // cap)
    return -(-tokens // chunks)


def _capped_chunk(tokens: int, room: int, cap: int) -> int:
    """Beside decodes: a prompt's next even chunk when it fits the ``room`` the step has
    left for prompt tokens, else 0 (it waits for the next step rather than starting with a
    fragment)."""
    chunk = _even_chunk(tokens, cap)
    return chunk if chunk <= room else 0


def _decodes(seq: Sequence) -> bool:
    """The sequence's next step computes its last sampled token only (not a prompt chunk,
    not a recompute)."""
    return bool(seq.output_token_ids) and seq.num_tokens_to_compute == 1


@dataclass
class ScheduledSeq:
    """One sequence's share of a step.

    ``start`` (the position of its first token computed this step) and ``samples`` are
    fixed when it is scheduled: ``update_from_output`` moves the sequence on afterwards.
    ``slot_mapping`` holds one slot per new token (positions ``start`` ..
    ``start + num_new_tokens - 1``, in order): what ``allocate_slots`` returned for them.
    ``block_table`` is the sequence's whole table after the step's allocations (filled in
    by ``schedule`` before it returns). Both are in the runner's addressing: a slot is
    ``page * block_size + offset`` where a page is the block id, or over a mixed-precision
    arena (``--kv-demotion``) the block's page code (``KVCacheManager.page_codes``)."""

    seq: Sequence
    num_new_tokens: int
    start: int
    slot_mapping: list[int]
    block_table: list[int] = field(default_factory=list)
    # the sliding-window group's table and slots (hybrid cache, engine.cache.window_group;
    # empty without one): what the windowed layers read and write
    window_table: list[int] = field(default_factory=list)
    window_slot_mapping: list[int] = field(default_factory=list)
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        # True when this chunk reaches the end of the known tokens: a token is sampled.
        self.samples = self.start + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """Everything the runner needs for one step (and the engine to process it).

    Invariants, once ``schedule`` returns it (nothing in it changes afterwards):
    - ``scheduled`` is in the order of the running queue, one entry per sequence; each
      entry's ``block_table`` covers its ``slot_mapping`` (see ``ScheduledSeq``).
    - The orders are every one the cache queued until ``schedule`` returned (copy-on-write
      copies of the previous step's forks included), each queue taken once. The runner
      executes them before the step's forward pass, in this order: ``demotions``
      ((source, destination) page codes: one batched gather then scatter, no order reads
      a page another writes), ``swap_rounds`` (in order, each round's gpu->cpu copies
      before its cpu->gpu ones; engine.cache.transfers), ``copies`` (copy-on-write
      (src, dst), in the runner's addressing).
    - ``preempted``: sequences this step took off the gpu (recompute or swap);
      ``truncated``: sequences finished "length" because they could never fit.
    """

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    truncated: list[Sequence] = field(default_factory=list)  # could never fit: finished
    demotions: list[tuple[int, int]] = field(default_factory=list)
    swap_rounds: list[Round | DiskBatch] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    # the sliding-window group's (group 1's) orders, over the windowed layers' pages
    # (hybrid cache): its swap rounds with ``swap_rounds`` (either may run first: disjoint
    # blocks and pages), its copy-on-write (src, dst) with ``copies``
    window_swap_rounds: list[Round] = field(default_factory=list)
    window_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampledToken:
    """What a step's sampling did to one sequence, as ``update_from_output`` applies it:
    ``token_id`` is appended to it, then, when ``finish_reason`` is set, it is finished.
    ``token_id`` None: nothing to append (a failed request's sequences are finished with
    reason "abort" so, in their place in the step's order)."""

    seq: Sequence
    token_id: int | None
    finish_reason: str | None = None


class Scheduler:
    """Owns the waiting and running queues; the cache manager owns the blocks."""

    def __init__(self, config: EngineConfig, cache, max_model_len: int) -> None:
        self.config = config
        self.cache = cache
        self.max_model_len = max_model_len
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []  # admission order
        self.swapped: list[Sequence] = []  # sorted by Sequence.sort_key; blocks on the cpu
        self.num_preemptions = 0
        # tokens computed as prefill, and those of them computed again after a recompute
        # preemption (engine.events.analysis.lifecycle counts them the same way)
        self.num_prefill_computed_tokens = 0
        self.num_recomputed_tokens = 0
        # a mixed-precision arena (--kv-demotion): the runner addresses pages by page code
        self._page_codes = cache.page_codes if cache.demotion is not None else None

    # ------------------------------------------------------------- queues
    def add(self, seq: Sequence) -> None:
        # The cache's priority is "larger is kept longer"; requests use vLLM's "lower runs
        # first", so an urgent request's blocks are the last to be evicted.
        self.cache.add_sequence(seq.seq_id, seq.prompt_token_ids, priority=-seq.priority)
        self._enqueue(seq)

    def add_forked(self, parent: Sequence, child: Sequence) -> None:
        """A child sharing all of ``parent``'s blocks; it runs alongside the parent."""
        self.cache.fork(parent.seq_id, child.seq_id)
        child.status = "running"
        self.running.append(child)

    def _enqueue(self, seq: Sequence, queue: list[Sequence] | None = None) -> None:
        queue = self.waiting if queue is None else queue
        seq.status = "waiting" if queue is self.waiting else "swapped"
        keys = [s.sort_key() for s in queue]
        queue.insert(bisect.bisect_right(keys, seq.sort_key()), seq)

    def abort(self, seqs: list[Sequence]) -> None:
        """Finish the sequences not finished yet with reason "abort" (their request failed
        or was aborted)."""
        for seq in seqs:
            if seq.status != "finished":
                self.finish(seq, "abort")

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence (finished, stopped or aborted) and free its blocks."""
        if seq.status == "running":
            self.running.remove(seq)
        elif seq.status == "waiting":
            self.waiting.remove(seq)
        elif seq.status == "swapped":
            self.swapped.remove(seq)
        seq.status = "finished"
        seq.finish_reason = reason
        seq.finished_time = time.monotonic()
        self.cache.finish(seq.seq_id, "abort" if reason == "abort" else
                          ("length" if reason == "length" else "stop"))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """The step's batch, with the cache's tables and orders for the runner. Over a
        mixed-precision arena, cold blocks are demoted first: that makes room for the next
        admission before the scheduler would evict cached prefixes or leave it waiting."""
        if self._page_codes is not None:
            self.cache.demote_cold_blocks(self._admission_need())
        if getattr(self.cache, "disk", None) is not None and self.config.enable_prefix_caching:
            self._start_prefetches()
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledSeq] = {}
        cap = self.config.max_prefill_tokens_with_decodes
        capped = bool(cap and self.config.enable_chunked_prefill
                      and any(_decodes(s) for s in self.running))
        cap = _prefill_cap(cap, len(self.waiting), budget) if capped else budget
        prefill_left = cap
        # Beside decodes, once a prompt stays unfinished in this step no later prompt starts
        # (prompts go one after the other, in order).
        prompts_closed = False

        used = prompt_used = 0  # tokens, and prompt tokens, of the sequences in `scheduled`
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status != "running":  # preempted earlier in this step
                continue
            n = min(seq.num_tokens_to_compute, budget)
            decodes = _decodes(seq)
            if not decodes:
                if prompts_closed:
                    continue
                if capped:  # the step's token budget may still cut the chunk short
                    n = min(_capped_chunk(seq.num_tokens_to_compute, prefill_left, cap), n)
                    prompts_closed = n < seq.num_tokens_to_compute
                else:
                    n = min(n, prefill_left)
                if n <= 0:
                    continue  # a later step goes on with this prompt
            # Counted as they go (a step may hold hundreds of sequences): _grow preempts
            # only sequences not scheduled yet, so nothing counted is ever taken back.
            slots = self._grow(seq, n, scheduled, out)
            if slots is not None:
                scheduled[seq.seq_id] = ScheduledSeq(seq, n, seq.num_computed_tokens, slots)
                used += n
                prompt_used += 0 if decodes else n
            budget = self.config.max_num_batched_tokens - used
            prefill_left = cap - prompt_used

        if not out.preempted:
            budget = self._swap_in(scheduled, budget, out)
            if not self.swapped and not prompts_closed:
                self._admit(scheduled, budget, prefill_left, cap if capped else 0)

        # Keep the order of self.running so batches are deterministic.
        out.scheduled = [scheduled[s.seq_id] for s in self.running if s.seq_id in scheduled]
        self._hand_over(out)
        return out

    def _hand_over(self, out: SchedulerOutput) -> None:
        """Take what the runner needs from the cache: every queued order, and each
        scheduled sequence's block table, in the runner's addressing."""
        cache, codes = self.cache, self._page_codes
        out.demotions = cache.take_demotion_orders()
        out.swap_rounds = cache.take_swap_rounds()
        out.copies = cache.take_copy_orders()
        if codes is None:
            for s in out.scheduled:
                s.block_table = cache.block_table(s.seq.seq_id)
            if cache.window is not None:
                out.window_swap_rounds = cache.take_window_swap_rounds()
                out.window_copies = cache.take_window_copy_orders()
                for s in out.scheduled:
                    sid = s.seq.seq_id
                    s.window_table = cache.window_table(sid)
                    s.window_slot_mapping = cache.window_slots(sid, s.start,
                                                               s.start + s.num_new_tokens)
            return
        bs = cache.block_size
        out.copies = [(codes([a])[0], codes([b])[0]) for a, b in out.copies]
        for s in out.scheduled:
            table = cache.block_table(s.seq.seq_id)
            s.block_table = codes(table)
            page = dict(zip(table, s.block_table, strict=True))
            s.slot_mapping = [page[x // bs] * bs + x % bs for x in s.slot_mapping]

    def _admission_need(self) -> int:
        """Blocks the first waiting sequence's next chunk needs (0: none waiting): demotion
        frees that many frames first. Capped by the running-sequence limit: no room is
        made for a sequence that could not run anyway."""
        cfg = self.config
        if not self.waiting or len(self.running) >= cfg.max_num_seqs:
            return 0
        seq = self.waiting[0]
        n = min(seq.num_tokens_to_compute, cfg.max_num_batched_tokens)
        return -(-n // cfg.block_size)

    def _grow(self, seq: Sequence, n: int, scheduled: dict[str, ScheduledSeq],
              out: SchedulerOutput) -> list[int] | None:
        """Get blocks for ``n`` more tokens of a running sequence, preempting others if
        needed: only sequences not scheduled in this step (``seq`` itself, maybe), so a
        step's scheduled tokens never shrink. Returns the tokens' slots; None when ``seq``
        itself had to go."""
        if self.config.kv_layout == "contiguous":  # everything was reserved at admission
            start = seq.num_computed_tokens
            table = self.cache.sequences[seq.seq_id].block_table
            return slot_mapping(table, self.cache.block_size, start, start + n)
        while (slots := self.cache.allocate_slots(seq.seq_id, n)) is None:
            victim = max((s for s in self.running if s.seq_id not in scheduled),
                         key=Sequence.sort_key)
            if victim is seq and len(self.running) == 1:
                # Alone in the cache and still too big: it can never fit.
                self.finish(seq, "length")
                out.truncated.append(seq)
                return None
            cause = {C.NEEDED_BY: seq.seq_id, C.BLOCKS_NEEDED: self.cache.blocks_needed(
                seq.seq_id, n), C.FREE_BLOCKS: self.cache.num_free_blocks,
                C.POLICY: C.PREEMPT_RULE, C.REASON: C.R_ALLOCATE}
            self._preempt(victim, out, cause)
            if victim is seq:
                return None
        seq.num_cache_write_tokens = self.cache.sequences[seq.seq_id].prompt_written
        return slots

    def _preempt(self, seq: Sequence, out: SchedulerOutput, cause: dict | None = None) -> None:
        self.running.remove(seq)
        mode = self.cache.preempt(seq.seq_id, self.config.preemption_mode, cause)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        if mode == "swap":  # its computed tokens stay valid, on the host
            self._enqueue(seq, self.swapped)
        else:
            seq.num_computed_tokens = 0
            self._enqueue(seq)

    def _swap_in(self, scheduled: dict[str, ScheduledSeq], budget: int,
                 out: SchedulerOutput) -> int:
        """Bring swapped sequences back while the cache and the budget allow; returns the
        budget left. Swapped sequences need no watermark: they were running already."""
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_tokens_to_compute, budget)
            # Alone and too big even with nothing else running: _grow finishes it.
            if not (self.cache.can_swap_in(seq.seq_id, n)
                    or not self.running and self.cache.can_swap_in(seq.seq_id, 0)):
                break
            self.swapped.pop(0)
            self.cache.swap_in(seq.seq_id)
            seq.status = "running"
            self.running.append(seq)
            slots = self._grow(seq, n, scheduled, out)
            if slots is not None:
                scheduled[seq.seq_id] = ScheduledSeq(seq, n, seq.num_computed_tokens, slots)
                budget -= n
        return budget

    def _admit(self, scheduled: dict[str, ScheduledSeq], budget: int, room: int,
               chunk_cap: int) -> None:
        """Admit waiting sequences while the step's ``budget`` tokens and its ``room`` for
        prompt tokens last. ``chunk_cap`` > 0 (beside decodes): each prompt starts only with
        a whole even chunk of the room (``_capped_chunk``; the budget may still cut it), and
        admission stops after one that stays unfinished."""
        contiguous = self.config.kv_layout == "contiguous"

        def chunk(seq: Sequence) -> int:
            n = min(seq.num_tokens_to_compute, budget, room)
            return min(n, _even_chunk(seq.num_tokens_to_compute, chunk_cap)) if chunk_cap else n

        while self.waiting and min(budget, room) > 0 and \
                len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self.config.enable_chunked_prefill and \
                    seq.num_tokens_to_compute > min(budget, room):
                break
            if chunk_cap and not _capped_chunk(seq.num_tokens_to_compute, room, chunk_cap):
                break
            n = chunk(seq)
            # Contiguous layout reserves the whole max_model_len up front.
            need = self.max_model_len if contiguous else n
            if not self.cache.can_allocate(seq.seq_id, need, self.config.watermark):
                break
            lookup = not contiguous and self.config.enable_prefix_caching and seq.prefix_lookup
            if lookup and self._waits_for_disk(seq):
                break  # its prefix is being read from disk: a bounded wait, in order
            if lookup:
                hit = self.cache.match_prefix(seq.seq_id)
                seq.num_computed_tokens = hit
                if not seq.ever_started:
                    seq.num_cached_tokens = hit
                n = chunk(seq)
            slots = self.cache.allocate_slots(seq.seq_id, need if contiguous else n)
            if slots is None:  # can_allocate said yes; only a prefix match could differ
                self.cache.free(seq.seq_id)  # undo the shared prefix; stays waiting
                seq.num_computed_tokens = 0
                break
            seq.num_cache_write_tokens = self.cache.sequences[seq.seq_id].prompt_written
            self.waiting.pop(0)
            seq.status = "running"
            self.running.append(seq)
            if seq.ever_started:
                self.cache.resume(seq.seq_id)
            else:
                seq.ever_started = True
                seq.first_scheduled_time = time.monotonic()
                self.cache.start(seq.seq_id)
            # contiguous: the whole reservation's slots; this step computes the first n
            scheduled[seq.seq_id] = ScheduledSeq(seq, n, seq.num_computed_tokens,
                                                 slots[:n] if contiguous else slots)
            budget -= n
            room -= n
            if chunk_cap and n < seq.num_tokens_to_compute:
                break  # this prompt goes on next step; nothing starts after it

    def _start_prefetches(self) -> None:
        """Start the disk reads of the first waiting sequences' prefixes, so they arrive
        while those wait (each sequence's are started once)."""
        for seq in self.waiting[:PREFETCH_AHEAD]:
            if seq.prefix_lookup:
                self._waits_for_disk(seq)

    def _waits_for_disk(self, seq: Sequence) -> bool:
        """Whether ``seq`` should keep waiting for disk reads of its prefix: True while
        reads are in flight and it has waited less than ``disk_prefetch_wait_s``; then it
        gives up (counted) and recomputes what has not arrived."""
        if seq.disk_done:
            return False
        if not self.cache.prefetch(seq.seq_id):
            seq.disk_done = True
            return False
        now = time.monotonic()
        if seq.disk_wait_since is None:
            seq.disk_wait_since = now
        if now - seq.disk_wait_since < self.config.disk_prefetch_wait_s:
            return True
        self.cache.give_up_prefetch(seq.seq_id)
        seq.disk_done = True
        return False

    @property
    def waiting_for_disk(self) -> bool:
        """A waiting sequence's disk reads are in flight (an idle step may pause)."""
        return any(s.disk_wait_since is not None and not s.disk_done
                   for s in self.waiting[:PREFETCH_AHEAD])

    # ---------------------------------------------------- after the forward
    def update_from_output(self, out: SchedulerOutput, sampled: list[SampledToken],
                           now: float) -> None:
        """The step's forward ran and its rows were sampled: every scheduled sequence's
        tokens are computed; then, in ``sampled``'s order, each token is appended (its
        sequence's first one stamped ``now``) and each finished sequence is finished (an
        abort only of a sequence not finished yet)."""
        for s in out.scheduled:
            self._count_prefill(s)
            s.seq.num_computed_tokens += s.num_new_tokens
        for u in sampled:
            seq = u.seq
            if u.token_id is not None:
                if seq.first_token_time is None:
                    seq.first_token_time = now
                self.cache.append_token_ids(seq.seq_id, [u.token_id])
            if u.finish_reason is not None and seq.status != "finished":
                self.finish(seq, u.finish_reason)

    def _count_prefill(self, s: ScheduledSeq) -> None:
        """Prefill and recomputed tokens, as engine.events.analysis.lifecycle counts them."""
        seq, a = s.seq, s.start
        pre, redo = classify_chunk(a, a + s.num_new_tokens, len(seq.prompt_token_ids),
                                   seq.max_computed_tokens)
        self.num_prefill_computed_tokens += pre
        self.num_recomputed_tokens += redo
        seq.max_computed_tokens = max(seq.max_computed_tokens, a + s.num_new_tokens)

    def end_step(self) -> dict[str, Any]:
        """Close the step's event batch (``seq_tokens`` of the sequences whose count
        changed); returns the cache's figures for the step stats
        (``KVCacheManager.metrics``)."""
        metrics = self.cache.metrics()
        self.cache.flush_step_events()
        return metrics

    def flush_events(self) -> None:
        """Make the cache's changes since the last step visible now (an abort between
        steps)."""
        self.cache.flush_step_events()
