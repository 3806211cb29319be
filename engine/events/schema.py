"""The kvscope event protocol: what a batch and each event look like on the wire.

Torch-free. A *batch* is one engine step:

    {"v": PROTOCOL_VERSION, "epoch": str, "step": int, "time": float (unix seconds),
     "events": [event, ...], "stats": {...}}

The publisher adds "seq" (strictly increasing per epoch) and "epoch". An *event* is a
self-describing map ``{"kind": KIND, ...fields}``. Block ids are ints, per tier,
``0 <= id < num_blocks``; bulk changes carry id lists (protocol 1: msgpack arrays of ints;
protocol 2: the same ids packed as little-endian int32 bytes, see ``BLOCK_ID_FIELDS``).
Sequence ids are strings.
Readers ignore fields they do not know and count (then ignore) kinds they do not know,
so adding a field or a kind never breaks a reader. What each kind *means* is defined in
one place only: ``engine.events.state.KVState.apply``.

Kinds and fields (``tier`` is "gpu" or "cpu"; ``blocks``/``src``/``dst`` are id lists):

    tier_init    tier, num_blocks, block_size, format    (re)create a tier, all blocks free
    seq_add      seq, prompt_tokens, priority=0, parent=None   new sequence, status waiting
    seq_start    seq                                     waiting -> running (first schedule)
    alloc        tier, seq, blocks                       fresh blocks appended to seq's table
    hit          tier, seq, blocks, tokens               cached blocks shared into seq's table
    store        tier, blocks, hashes                    full blocks enter the prefix cache
    evict        tier, blocks                            blocks leave the prefix cache
    free         tier, seq, blocks                       seq drops its whole block table
    fork         tier, seq, parent, blocks               child shares all of parent's blocks
    cow          tier, seq, logical, src, dst            copy-on-write: table[logical[i]] src->dst
    seq_tokens   seqs, num_tokens                        token counts of sequences that changed
    seq_preempt  seq, mode ("recompute" | "swap")        running -> waiting | swapped
    seq_resume   seq                                     waiting | swapped -> running
    seq_finish   seq, reason ("stop" | "length" | "abort")   sequence leaves (table empty)
    swap_out     seq, src, dst                           seq's table moves gpu src -> cpu dst
    swap_in      seq, src, dst                           seq's table moves cpu src -> gpu dst
    offload      src, dst, hashes                        cached gpu blocks written to host dst
    host_hit     seq, src, dst, tokens                   host-cached src loaded into gpu dst
    quantize     tier, blocks, format                    demotion: the blocks' format changes
                                                         in place (refs, hashes, tables kept);
                                                         a block that becomes free reverts to
                                                         the tier's format

Optional ``cause`` on ``seq_preempt`` and ``evict`` (engine.events.causes; older readers
ignore it, and readers must accept its absence): ``{"needed_by": seq | None,
"blocks_needed", "free_blocks", "policy", "reason", "fallback"?}``: the sequence whose
allocation forced the decision, how many blocks it asked for, how many it could take at
that moment, the rule that picked the victim and what kind of allocation it was.
Optional on ``seq_finish``: ``num_tokens`` (positions computed, including its last step,
which no ``seq_tokens`` reports) and ``output_tokens`` (tokens it generated).

``stats`` is a free-form map; known keys: gauges running, waiting, swapped,
scheduled_tokens, prefill_tokens, decode_tokens, step_time_s and "tiers": {tier: {"total",
"used", "cached", "free"}}; counters hit_tokens, query_tokens (prefix cache, in tokens),
preemptions, evictions, cow_copies, swap_out_blocks, swap_in_blocks,
prefill_computed_tokens, recomputed_tokens (engine.events.analysis.lifecycle's accounting).
Counters are cumulative since the engine started (as Prometheus counters), so a reader that
joins late or misses batches still reads correct totals; per-step rates are differences.
"""

from __future__ import annotations

PROTOCOL_VERSION = 2
# Version 2 differs from 1 only in the wire form of id lists (``BLOCK_ID_FIELDS``: packed
# little-endian int32 bytes, msgpack bin) and in snapshots (ref counts and id lists
# packed, hashes packed int64). Readers take both; version-1 recordings replay as before.
READABLE_VERSIONS = (1, 2)
BLOCK_ID_FIELDS = ("blocks", "src", "dst")

TIERS = ("gpu", "cpu")
SEQ_STATUSES = ("waiting", "running", "swapped")
FINISH_REASONS = ("stop", "length", "abort")
PREEMPT_MODES = ("recompute", "swap")
KV_FORMATS = ("auto", "fp16", "bf16", "fp32", "fp8", "int8", "int4")

# Event kinds. Names are the wire strings.
TIER_INIT = "tier_init"
SEQ_ADD = "seq_add"
SEQ_START = "seq_start"
ALLOC = "alloc"
HIT = "hit"
STORE = "store"
EVICT = "evict"
FREE = "free"
FORK = "fork"
COW = "cow"
SEQ_TOKENS = "seq_tokens"
SEQ_PREEMPT = "seq_preempt"
SEQ_RESUME = "seq_resume"
SEQ_FINISH = "seq_finish"
SWAP_OUT = "swap_out"
SWAP_IN = "swap_in"
OFFLOAD = "offload"
HOST_HIT = "host_hit"
QUANTIZE = "quantize"

EVENT_KINDS = (
    TIER_INIT, SEQ_ADD, SEQ_START, ALLOC, HIT, STORE, EVICT, FREE, FORK, COW, SEQ_TOKENS,
    SEQ_PREEMPT, SEQ_RESUME, SEQ_FINISH, SWAP_OUT, SWAP_IN, OFFLOAD, HOST_HIT, QUANTIZE,
)

# Per-block state codes, as the inspector's uint8 block map uses them. Derived from a
# block's ref count and whether it holds a prefix-cache hash (see KVState.block_codes).
BLOCK_FREE = 0  # ref 0, no hash: reused first
BLOCK_CACHED = 1  # ref 0, hashed: evictable, revivable by a prefix hit
BLOCK_USED = 2  # ref 1
BLOCK_SHARED = 3  # ref > 1
BLOCK_STATE_NAMES = ("free", "cached", "used", "shared")


class ProtocolError(ValueError):
    """A batch or event that does not follow the protocol (or does not fit the state)."""

# Optional ``store`` fields, present when the sink's ``store_detail`` is on (a vLLM-format
# publisher listens): per stored block, its parent's chain hash (None for a sequence's
# first block) and its token ids. Readers that do not need them ignore them.
STORE_PARENTS = "parents"
STORE_TOKENS = "tokens"
