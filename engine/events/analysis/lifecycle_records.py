"""What the lifecycle index records: the phases a sequence goes through, its preemptions
and disk prefetches (``SeqLife``), the prefix tree's nodes, and the token accounting both
the index and the engine's own counter use (``classify_chunk``). lifecycle.py's docstring
says how they are built from events. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# phases (the lifecycle Gantt's colours); "finished" is the row's end, not a phase
WAITING = "waiting"  # added, never scheduled
PREFILL = "prefill"  # computing its prompt (or its history again), chunk by chunk
RUNNING = "running"  # decoding (or scheduled-out between decode steps)
PREEMPTED = "preempted"  # back in the waiting queue after a recompute preemption
SWAPPED = "swapped"  # preempted by swap: its blocks are on the host
PHASES = (WAITING, PREFILL, RUNNING, PREEMPTED, SWAPPED)

DECODE_CONTEXT_BIN = 64  # tokens per bin of decode time by context length

# per-step columns (all ints except where noted)
STEP_COLUMNS = (
    "step", "time", "step_time",  # floats: end of step (unix s), duration (s)
    "running", "waiting", "swapped",
    "gpu_used", "cpu_used", "gpu_total", "cpu_total",
    "prefill_tokens", "recomputed_tokens", "decode_tokens",
    "hit_tokens", "query_tokens",  # cumulative (engine counters; -1 when not recorded)
    "finished", "preemptions", "evicted_blocks", "swap_out_blocks", "swap_in_blocks",
    "occupied_tokens", "occupied_slots",  # token- vs block-level occupancy (gpu)
    "decode_context_tokens",  # sum of the context lengths of this step's decoded tokens
)


def classify_chunk(a: int, b: int, prompt_tokens: int, high_water: int) -> tuple[int, int]:
    """(prefill tokens, recomputed tokens) of a chunk computing positions [a, b)."""
    n = b - a
    if n <= 0:
        return 0, 0
    if n == 1 and a >= max(prompt_tokens, high_water):
        return 0, 0  # a decode
    return n, max(0, min(b, high_water) - a)


@dataclass
class Phase:
    kind: str
    start_step: int
    start_time: float
    end_step: int | None = None  # exclusive: the step the next phase (or the end) began
    end_time: float | None = None
    detail: str = ""  # preempted/swapped: the cause, as one line


@dataclass
class Preemption:
    step: int
    time: float
    mode: str
    cause: dict[str, Any] | None


# how a prefetch ended (PrefetchSpan.outcome)
ARRIVED = "arrived"  # every read came back (intact or missed) before the sequence started
RECOMPUTED = "recomputed"  # it started with reads outstanding: those blocks are recomputed
LEFT = "left"  # it finished (aborted) while still waiting


@dataclass
class PrefetchSpan:
    """One disk prefetch of a waiting sequence: ``blocks`` reads started at
    ``start_step``; ``arrived``/``missed`` of them came back (``disk_load``), the last at
    ``arrive_step``; it ends (``end_step``, ``outcome``) when the sequence starts
    (``seq_start``) or finishes. A block the cache no longer needed when its read came
    back is in neither count, so ``arrived + missed < blocks`` with outcome ``arrived``
    cannot happen: such a prefetch reads as ``recomputed`` (what it did not get from
    disk, it computed)."""

    start_step: int
    start_time: float
    blocks: int
    arrived: int = 0
    missed: int = 0
    arrive_step: int | None = None
    arrive_time: float | None = None
    end_step: int | None = None
    end_time: float | None = None
    outcome: str | None = None  # None while in flight

    @property
    def wait_s(self) -> float | None:
        """How long the sequence waited for its reads (None while in flight)."""
        return None if self.end_time is None else self.end_time - self.start_time


@dataclass
class SeqLife:
    seq_id: str
    prompt_tokens: int
    priority: int
    parent: str | None
    add_step: int
    add_time: float
    phases: list[Phase] = field(default_factory=list)
    blocks: list[tuple[int, int]] = field(default_factory=list)  # (step, blocks held)
    hits: list[tuple[int, int]] = field(default_factory=list)  # (step, cumulative hit tok)
    preemptions: list[Preemption] = field(default_factory=list)
    prefetches: list[PrefetchSpan] = field(default_factory=list)
    first_token_step: int | None = None
    first_token_time: float | None = None
    finish_step: int | None = None
    finish_time: float | None = None
    finish_reason: str | None = None
    output_tokens: int = 0
    prefill_tokens: int = 0
    recomputed_tokens: int = 0
    hit_tokens: int = 0
    # running bookkeeping
    tokens: int = 0  # computed positions the cache holds (the mirror's num_tokens)
    high_water: int = 0
    num_blocks: int = 0
    tier: str = "gpu"
    status: str = "waiting"  # waiting | running | swapped | finished

    @property
    def request_id(self) -> str:
        return self.seq_id.split("#", 1)[0]

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.add_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (finished sequences only)."""
        if self.finish_time is None or self.first_token_time is None or self.output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.output_tokens - 1)

    @property
    def phase(self) -> str | None:
        """The current phase (None once finished)."""
        return None if self.finish_step is not None or not self.phases else self.phases[-1].kind


@dataclass
class PrefixNode:
    """One cached block's content (a hash) in the prefix tree, built from hit chains."""

    hash: int
    parent: int | None
    depth: int
    first_step: int
    hits: int = 0
    tokens_saved: int = 0
    last_hit_step: int = -1
    seqs: set[str] = field(default_factory=set)
    children: set[int] = field(default_factory=set)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)
