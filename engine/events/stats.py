"""The step statistics: a batch's ``stats`` map, as one named type shared by its producer
(the engine's ``_close_step``) and its readers (``/metrics``, the inspector, the router,
the lifecycle analysis).

On the wire it stays a plain map, one key per field that the producer reported (a field
left None is not written): ``StepStats.to_map()``. Readers go through
``StepStats.read(map)``, which takes any map: a key it does not know is ignored (a newer
engine's), a key that is missing, or whose value is not of its field's type (an older or
hostile recording), reads as None, "not reported". Readers choose what None means to
them (0 for a plot, "unknown" for a rate).

Gauges describe the step just closed; counters are cumulative since the engine started
(as Prometheus counters), so a reader that joins late or misses batches still reads
correct totals, and per-step rates are differences. Torch-free.
"""

from __future__ import annotations

from typing import Any

import msgspec

_STRUCT = {"kw_only": True, "omit_defaults": True, "gc": False}


class TierStats(msgspec.Struct, **_STRUCT):
    """One tier's blocks at the step's end (a reporter may give total, free and cached
    only)."""

    total: int | None = None
    used: int | None = None  # ref > 0
    cached: int | None = None  # ref 0, hashed: evictable
    free: int | None = None  # ref 0, no hash

    def used_blocks(self) -> int | None:
        """``used``, else ``total - free - cached`` when those are given, else None."""
        if self.used is not None:
            return self.used
        if None in (self.total, self.free, self.cached):
            return None
        return self.total - self.free - self.cached  # type: ignore[operator]

    @classmethod
    def read(cls, m: Any) -> TierStats:
        return _read(cls, m)


class StepStats(msgspec.Struct, **_STRUCT):
    """One engine step's statistics (None: not reported)."""

    # gauges: the step just closed
    running: int | None = None  # sequences running after the step
    waiting: int | None = None  # sequences waiting (queued or preempted by recompute)
    swapped: int | None = None  # sequences swapped out to the cpu tier
    scheduled_tokens: int | None = None  # tokens the step computed
    prefill_tokens: int | None = None  # of them, in prefill chunks (> 1 token per sequence)
    decode_tokens: int | None = None  # of them, single-token decodes
    # counters
    preemptions: int | None = None  # sequences preempted
    # gauges
    step_time_s: float | None = None  # the step's wall time
    # counters: the prefix cache, in tokens
    hit_tokens: int | None = None  # prompt tokens served from the cache
    query_tokens: int | None = None  # prompt tokens looked up
    evictions: int | None = None  # cached blocks evicted
    cow_copies: int | None = None  # copy-on-write block copies
    demoted_blocks: int | None = None  # blocks demoted to a lower-precision format
    # gauges
    used_tokens: int | None = None  # token slots filled in used gpu blocks (shared once)
    tiers: dict[str, TierStats] | None = None  # per tier ("gpu", "cpu")
    # counters: engine.events.analysis.lifecycle's accounting
    prefill_computed_tokens: int | None = None  # prompt positions computed
    recomputed_tokens: int | None = None  # of them, recomputed after a preemption
    # counters of the cpu tier (reported when the engine has one)
    copied_out_blocks: int | None = None  # gpu -> host block copies (swaps, write-backs)
    copied_in_blocks: int | None = None  # host -> gpu block copies (swaps, host hits)
    swap_out_bytes: int | None = None
    swap_in_bytes: int | None = None
    swap_rounds: int | None = None  # batched copy rounds issued
    swap_time_s: float | None = None  # time spent copying
    swap_outs: int | None = None  # sequences swapped out
    swap_ins: int | None = None  # sequences swapped in
    swap_out_blocks: int | None = None  # table entries moved to the host
    swap_in_blocks: int | None = None  # table entries moved back
    offloaded_blocks: int | None = None  # evicted cached gpu blocks written to the host
    host_hit_tokens: int | None = None  # prefix tokens loaded from the host
    swap_fallbacks: int | None = None  # swap preemptions done by recompute (host full)
    # counter of the event stream (added by the EventStream to every batch)
    dropped_batches: int | None = None  # batches it dropped (its queue was full)
    recording_error: str | None = None  # why its recording stopped early (absent: it did not)

    def to_map(self) -> dict[str, Any]:
        """The wire form: a map of the reported fields."""
        return msgspec.to_builtins(self)

    @classmethod
    def read(cls, m: Any) -> StepStats:
        """Any batch's ``stats`` (or a StepStats): never raises (see module docstring)."""
        return m if isinstance(m, StepStats) else _read(cls, m)

    def tier(self, name: str) -> TierStats:
        """The tier's stats; all None when not reported."""
        t = self.tiers.get(name) if self.tiers else None
        return t if t is not None else TierStats()


def _read(cls: type[msgspec.Struct], m: Any) -> Any:
    """``m`` as ``cls``: at once when every known key has its field's type (the common
    case), else field by field, dropping the values that do not fit."""
    if not isinstance(m, dict):
        return cls()
    try:
        return msgspec.convert(m, cls)
    except msgspec.ValidationError:
        pass
    fields: dict[str, Any] = {}
    for f in msgspec.structs.fields(cls):
        value = m.get(f.encode_name)
        if f.name == "tiers" and isinstance(value, dict):
            fields[f.name] = {k: TierStats.read(v) for k, v in value.items()
                              if isinstance(k, str)}
            continue
        try:
            fields[f.name] = msgspec.convert(value, f.type, strict=False)
        except msgspec.ValidationError:
            pass
    return cls(**fields)


def fields_text() -> str:
    """``running: int, ...``: the fields and their types, every one optional (``python -m
    engine.events``; what each counts is commented in ``StepStats``)."""
    from kvscope.engine.events.schema import type_name

    tier = ", ".join(f.name for f in msgspec.structs.fields(TierStats))
    return ", ".join(
        f"{f.name}: {{tier: {tier}}}" if f.name == "tiers"
        else f"{f.name}: {type_name(f.type).removesuffix(' | None')}"
        for f in msgspec.inspect.type_info(StepStats).fields)
