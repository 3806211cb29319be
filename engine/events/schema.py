"""The kvscope event protocol: what a batch and each event look like on the wire.

Torch-free. A *batch* is one engine step:

    {"v": PROTOCOL_VERSION, "epoch": str, "step": int, "time": float (unix seconds),
     "events": [event, ...], "stats": {...}}

The publisher adds "seq" (strictly increasing per epoch) and "epoch". An *event* is a
self-describing map ``{"kind": KIND, ...fields}``. Each kind is declared once, below, as
a typed structure (an ``Event`` subclass tagged with its wire name): its fields, their
types, which are optional, and what it means. ``python -m engine.events`` prints them as
a table. Block ids are ints, per tier, ``0 <= id < num_blocks``; bulk changes carry id
lists (``BlockIds``: protocol 1 writes msgpack arrays of ints, protocol 2 the same ids
packed as little-endian int32 bytes, in the fields ``BLOCK_ID_FIELDS``). Sequence ids are
strings; ``tier`` is "gpu", "cpu" or "disk" (the disk tier: its block ids are slots of
its file index, engine.cache.disk_tier).

Readers ignore fields they do not know and count (then ignore) kinds they do not know,
so adding a field or a kind never breaks a reader. An optional field may be absent;
readers take its absence as the default its kind's docstring names. What each kind
*means* is defined in one place only: ``engine.events.state.KVState.apply``.

``stats`` is the step's statistics map, declared as ``engine.events.stats.StepStats``.

The events are plain maps in the engine (``sink.emit(kind, **fields)``) and after
decoding; the types here are the contract both sides follow. The codec checks every
decoded event of a known kind against its type and hands it on with the fields its type
declares (``engine.events.wire.codec``); ``tests/events/test_schema.py`` checks that
what the cache manager emits fits the types.
"""

from __future__ import annotations

from typing import Any, TypeVar, Union

import msgspec
from msgspec import UNSET, UnsetType

from kvscope.engine.events import formats as _formats
from kvscope.engine.events.causes import Cause

PROTOCOL_VERSION = 3
# Version 2 differs from 1 only in the wire form of id lists (``BLOCK_ID_FIELDS``: packed
# little-endian int32 bytes, msgpack bin) and in snapshots (ref counts and id lists
# packed, hashes packed int64). Version 3 adds one optional batch field, ``cols``: a
# step's hot events as packed little-endian columns (engine.events.columns; then
# ``events`` holds only the others), written for bulk steps. Readers take all three;
# version-1 and 2 recordings replay as before.
READABLE_VERSIONS = (1, 2, 3)

TIERS = ("gpu", "cpu", "disk")
SEQ_STATUSES = ("waiting", "running", "swapped")
FINISH_REASONS = ("stop", "length", "abort")
PREEMPT_MODES = ("recompute", "swap")
# The page formats a tier_init may report, and those whose pages hold codes, not the
# model's dtype (the inspector's quantized hues): both from the registry (engine.events.formats)
KV_FORMATS = _formats.NAMES
QUANTIZED_KV_FORMATS = _formats.QUANTIZED_KV_FORMATS

# Event kinds. Names are the wire strings (each ``Event`` subclass below is tagged with one).
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
DISK_STORE = "disk_store"
PREFETCH = "prefetch"
DISK_LOAD = "disk_load"
RELEASE = "release"


def group_pool(tier: str, group: int) -> str:
    """The mirror's name for a cache group's pool: the tier for group 0 (every producer
    before the hybrid cache), ``"gpu/1"`` for the sliding-window group 1 of the gpu tier
    (engine.cache.window_group)."""
    return tier if not group else f"{tier}/{group}"

# Per-block state codes, as the inspector's uint8 block map uses them. Derived from a
# block's ref count and whether it holds a prefix-cache hash (see KVState.block_codes).
BLOCK_FREE = 0  # ref 0, no hash: reused first
BLOCK_CACHED = 1  # ref 0, hashed: evictable, revivable by a prefix hit
BLOCK_USED = 2  # ref 1
BLOCK_SHARED = 3  # ref > 1
BLOCK_STATE_NAMES = ("free", "cached", "used", "shared")


class ProtocolError(ValueError):
    """A batch or event that does not follow the protocol (or does not fit the state)."""


# ------------------------------------------------------------------- field types
BlockIds = list[int] | bytes
"""A list of block ids: msgpack ints (protocol 1) or packed little-endian int32 (2)."""

_T = TypeVar("_T")
Opt = _T | UnsetType
"""An optional field: absent (``UNSET``) unless the writer has it. Absence is kept apart
from every value (a default would be left out when sent explicitly), so a decoded event
holds exactly the declared fields that were sent."""


class Event(msgspec.Struct, tag_field="kind", kw_only=True, omit_defaults=True,
            gc=False):
    """One change of the cache's state. Subclasses are the kinds, tagged with their wire
    name; a subclass's docstring says what the kind means (first paragraph) and what a
    reader takes for its absent optional fields (the rest)."""


# Events, in the order of EVENT_KINDS. The field comments say what a field holds where
# its name does not.
class TierInit(Event, tag=TIER_INIT):
    """(Re)create a tier, all blocks free.

    Absent format: "auto". Absent group: 0. A group other than 0 is a KV cache group's
    own pool in that tier (the hybrid cache's sliding-window layers, group 1): the block
    events that name the same group address it, and its sequences' tables (``group``
    in alloc, hit, store, evict, free, fork, cow, release, swap_out, swap_in, offload;
    absent: 0, every producer
    before groups). A group's pool has its own prefix index: ``store``/``evict`` with
    a group set and drop its blocks' hashes, ``hit`` shares them into the sequence's
    table of that group (whose hit tokens group 0's ``hit`` counts)."""

    tier: str
    num_blocks: int
    block_size: int  # tokens per block
    format: Opt[str] = UNSET  # the tier's KV page format (KV_FORMATS)
    group: Opt[int] = UNSET  # the KV cache group whose pool this is (hybrid cache)


class SeqAdd(Event, tag=SEQ_ADD):
    """A new sequence, status waiting.

    Absent: prompt_tokens 0, priority 0, parent None."""

    seq: str
    prompt_tokens: Opt[int] = UNSET
    priority: Opt[int] = UNSET
    parent: Opt[str | None] = UNSET  # the sequence it was forked from


class SeqStart(Event, tag=SEQ_START):
    """Waiting -> running (its first schedule)."""

    seq: str


class Alloc(Event, tag=ALLOC):
    """Fresh blocks appended to the sequence's block table."""

    tier: str
    seq: str
    blocks: BlockIds
    group: Opt[int] = UNSET  # KV cache group (absent: 0; see tier_init)


class Hit(Event, tag=HIT):
    """Cached blocks shared into the sequence's block table.

    Absent tokens: 0."""

    tier: str
    seq: str
    blocks: BlockIds
    tokens: Opt[int] = UNSET  # prompt tokens the hit saves computing
    group: Opt[int] = UNSET  # KV cache group (absent: 0; see tier_init)


class Store(Event, tag=STORE):
    """Full blocks enter the prefix cache under their chain hashes."""

    tier: str
    blocks: BlockIds
    hashes: list[int]
    # with the sink's ``store_detail`` (a vLLM-format publisher listens): per block, its
    # parent's chain hash (None for a sequence's first block) and its token ids
    parents: Opt[list[int | None]] = UNSET
    tokens: Opt[list[list[int]]] = UNSET
    group: Opt[int] = UNSET  # KV cache group (absent: 0; see tier_init)


class Evict(Event, tag=EVICT):
    """Blocks leave the prefix cache (their hashes are dropped)."""

    tier: str
    blocks: BlockIds
    cause: Opt[Cause] = UNSET  # why (engine.events.causes)
    group: Opt[int] = UNSET  # KV cache group (absent: 0; see tier_init)


class Free(Event, tag=FREE):
    """The sequence drops its whole block table."""

    tier: str
    seq: str
    blocks: BlockIds  # the table, in order
    group: Opt[int] = UNSET  # KV cache group (absent: 0; see tier_init)


class Fork(Event, tag=FORK):
    """The child sequence shares all of its parent's blocks."""

    tier: str
    seq: str
    parent: str
    blocks: BlockIds  # the parent's table
    group: Opt[int] = UNSET  # KV cache group (absent: 0; see tier_init)


class Cow(Event, tag=COW):
    """Copy-on-write: ``table[logical[i]]`` moves from ``src[i]`` to ``dst[i]``."""

    tier: str
    seq: str
    logical: list[int]
    src: BlockIds
    dst: BlockIds
    group: Opt[int] = UNSET  # KV cache group (absent: 0; see tier_init)


class SeqTokens(Event, tag=SEQ_TOKENS):
    """Token counts of the sequences that changed this step."""

    seqs: list[str]
    num_tokens: list[int]


class SeqPreempt(Event, tag=SEQ_PREEMPT):
    """Running -> waiting (mode "recompute") or swapped (mode "swap")."""

    seq: str
    mode: str  # PREEMPT_MODES
    cause: Opt[Cause] = UNSET  # why (engine.events.causes)


class SeqResume(Event, tag=SEQ_RESUME):
    """Waiting or swapped -> running."""

    seq: str


class SeqFinish(Event, tag=SEQ_FINISH):
    """The sequence leaves (its table is empty).

    Absent counts: not reported."""

    seq: str
    reason: str  # FINISH_REASONS
    # positions computed, including its last step (which no seq_tokens reports)
    num_tokens: Opt[int] = UNSET
    output_tokens: Opt[int] = UNSET  # tokens it generated


class SwapOut(Event, tag=SWAP_OUT):
    """The sequence's table moves from gpu ``src`` to cpu ``dst``. With a group other
    than 0: its table of that group, between the group's pools of the two tiers."""

    seq: str
    src: BlockIds
    dst: BlockIds
    group: Opt[int] = UNSET  # KV cache group (absent: 0; see tier_init)


class SwapIn(Event, tag=SWAP_IN):
    """The sequence's table moves from cpu ``src`` to gpu ``dst`` (``group``: as in
    swap_out)."""

    seq: str
    src: BlockIds
    dst: BlockIds
    group: Opt[int] = UNSET  # KV cache group (absent: 0; see tier_init)


class Offload(Event, tag=OFFLOAD):
    """Cached gpu blocks ``src`` are written to host blocks ``dst``, cached there (in the
    pools of ``group``)."""

    src: BlockIds
    dst: BlockIds
    hashes: list[int]
    group: Opt[int] = UNSET  # KV cache group (absent: 0; see tier_init)


class HostHit(Event, tag=HOST_HIT):
    """Host-cached ``src`` loaded into gpu ``dst``, appended to the table.

    Absent tokens: 0."""

    seq: str
    src: BlockIds
    dst: BlockIds
    tokens: Opt[int] = UNSET  # prompt tokens the hit saves computing


class Quantize(Event, tag=QUANTIZE):
    """Demotion: the blocks' page format changes in place (refs, hashes and tables kept;
    a block that becomes free reverts to the tier's format)."""

    tier: str
    blocks: BlockIds
    format: str


class DiskStore(Event, tag=DISK_STORE):
    """Host blocks ``src``, just evicted from the host (``evict``, tier cpu, comes first),
    are written to disk blocks ``dst``, cached there under ``hashes``. (Leaving the disk
    is ``evict`` with tier "disk"; a daemon that starts over a warm directory reports the
    files it serves as ``store`` on tier "disk".)"""

    src: BlockIds
    dst: BlockIds
    hashes: list[int]


class Prefetch(Event, tag=PREFETCH):
    """A waiting sequence's prefix continues in disk blocks ``src``: their reads start
    (they stay cached on disk and cannot be evicted until they arrive)."""

    seq: str
    src: BlockIds


class DiskLoad(Event, tag=DISK_LOAD):
    """Reads of a prefetch arrived: disk blocks ``src`` are now also host blocks ``dst``,
    cached there under their hashes (a later ``host_hit`` takes them to the gpu). Blocks
    of the prefetch that are not in ``src`` did not arrive intact (missed reads, then
    ``evict`` on tier disk) or were no longer needed.

    Absent missed: 0."""

    seq: str
    src: BlockIds
    dst: BlockIds
    missed: Opt[int] = UNSET  # reads that found no intact file


class Release(Event, tag=RELEASE):
    """The oldest held blocks of the sequence's table in a sliding-window group leave it:
    no query still to come can see them (hybrid cache, engine.cache.window_group)."""

    tier: str
    seq: str
    group: int
    blocks: BlockIds  # the table's first held entries, in order


EVENT_TYPES: dict[str, type[Event]] = {
    cls.__struct_config__.tag: cls for cls in (
        TierInit, SeqAdd, SeqStart, Alloc, Hit, Store, Evict, Free, Fork, Cow, SeqTokens,
        SeqPreempt, SeqResume, SeqFinish, SwapOut, SwapIn, Offload, HostHit, Quantize,
        DiskStore, Prefetch, DiskLoad, Release)
}
EVENT_KINDS = tuple(EVENT_TYPES)
AnyEvent = Union[tuple(EVENT_TYPES.values())]  # noqa: UP007 (a tagged union, by "kind")

# The id-list fields (packed on the wire in protocol 2), from the types.
BLOCK_ID_FIELDS = tuple(dict.fromkeys(
    f.name for cls in EVENT_TYPES.values() for f in msgspec.structs.fields(cls)
    if f.type == BlockIds))
# Optional ``store`` fields, present when the sink's ``store_detail`` is on.
STORE_PARENTS = "parents"
STORE_TOKENS = "tokens"


# --------------------------------------------------------------------- the table
def type_name(t: Any) -> str:
    """A short name for a field's type (``msgspec.inspect`` form): "int", "ids",
    "list[str]", "str | None", a struct's class name."""
    mi = msgspec.inspect
    if isinstance(t, mi.UnionType):
        names = [type_name(x) for x in t.types]
        return "ids" if sorted(names) == ["bytes", "list[int]"] else " | ".join(names)
    if isinstance(t, mi.ListType):
        return f"list[{type_name(t.item_type)}]"
    if isinstance(t, mi.DictType):
        return "map"
    if isinstance(t, mi.StructType):
        return t.cls.__name__
    if isinstance(t, mi.NoneType):
        return "None"
    if isinstance(t, mi.AnyType):
        return "any"
    return type(t).__name__.removesuffix("Type").lower()


def fields_text(cls: type[msgspec.Struct]) -> str:
    """``tier: str, blocks: ids, cause?: Cause`` (``?``: optional)."""
    info = msgspec.inspect.type_info(cls)
    return ", ".join(f"{f.name}{'' if f.required else '?'}: {type_name(f.type)}"
                     for f in info.fields)


def meaning(cls: type) -> str:
    """The first paragraph of a class's docstring, on one line."""
    return " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())


def kinds_table() -> str:
    """One line per kind: its wire name, its fields, its meaning."""
    rows = [(kind, fields_text(cls), meaning(cls)) for kind, cls in EVENT_TYPES.items()]
    w = max(len(k) for k, _, _ in rows)
    return "\n".join(f"{k:<{w}}  {f}\n{'':<{w}}    {m}" for k, f, m in rows)
