"""Named, seeded workloads for ``kvscope load`` (definitions in assets/workloads/*.json).

A workload turns (seed, rate, duration) into a list of ``Session``s: a start time, an
optional system prompt and the user turns of one conversation. Turn k+1 is sent after
turn k's answer arrives (the history, answers included, grows each turn), so the runner
builds the messages; everything random here comes from one ``random.Random(seed)``, so
the same arguments give the same sessions.

Generators (the JSON's "generator"):
  chat     a system prompt shared by every session, questions, optional follow-up turns
           (shared-system-prompt chat, multi-turn conversations, bursty arrivals)
  doc_qa   a few long real documents, many questions about each (document QA)
  mixed    mostly short questions, some long excerpts to summarise (mixed short/long)
Arrivals: "poisson" (mean ``rate`` sessions/s) or "bursty" (bursts of ``burst_size``
sessions at once, bursts at mean rate ``rate / burst_size``).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

WORKLOAD_DIR = Path(str(files("kvscope") / "workloads"))  # assets/ (setup.py)
REPO = Path(__file__).resolve().parents[2]


class WorkloadError(ValueError):
    pass


@dataclass
class Session:
    start_s: float
    system: str | None
    turns: list[str]
    max_tokens: int
    think_s: float = 0.0
    tag: str = ""  # what the session is (for the log / tests)


@dataclass
class Workload:
    name: str
    description: str
    generator: str
    arrival: dict[str, Any]
    defaults: dict[str, Any]
    params: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


def list_workloads() -> list[str]:
    return sorted(p.stem for p in WORKLOAD_DIR.glob("*.json"))


def load_workload(name_or_path: str) -> Workload:
    """A workload by name (assets/workloads/NAME.json) or by path to a JSON file."""
    path = Path(name_or_path)
    if not path.suffix:
        path = WORKLOAD_DIR / f"{name_or_path}.json"
    if not path.is_file():
        raise WorkloadError(f"no workload {name_or_path!r}; named ones: "
                            f"{', '.join(list_workloads())}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise WorkloadError(f"{path}: {e}") from None
    try:
        w = Workload(name=raw["name"], description=raw.get("description", ""),
                     generator=raw["generator"], arrival=raw.get("arrival", {}),
                     defaults=raw.get("defaults", {}), params=raw.get("params", {}), path=path)
    except (KeyError, TypeError) as e:
        raise WorkloadError(f"{path}: missing or bad field {e}") from None
    if w.generator not in GENERATORS:
        raise WorkloadError(f"{path}: generator must be one of {sorted(GENERATORS)}")
    if w.arrival.get("pattern", "poisson") not in ("poisson", "bursty"):
        raise WorkloadError(f"{path}: arrival pattern must be poisson or bursty")
    return w


def arrivals(w: Workload, rng: random.Random, rate: float, duration: float,
             limit: int | None) -> list[float]:
    """Session start times in [0, duration), at most ``limit``."""
    if rate <= 0:
        raise WorkloadError(f"rate must be > 0, got {rate}")
    burst = int(w.arrival.get("burst_size", 1)) if w.arrival.get("pattern") == "bursty" else 1
    times: list[float] = []
    t = 0.0
    while t < duration and (limit is None or len(times) < limit):
        times.extend([t] * burst)
        t += rng.expovariate(rate / burst)
    return times[:limit] if limit is not None else times


def sessions(w: Workload, *, seed: int, rate: float, duration: float,
             max_sessions: int | None = None, max_tokens: int | None = None) -> list[Session]:
    rng = random.Random(seed)
    starts = arrivals(w, rng, rate, duration, max_sessions)
    budget = max_tokens or int(w.defaults.get("max_tokens", 32))
    make = GENERATORS[w.generator]
    out = [make(w.params, rng, t, budget) for t in starts]
    if max_tokens is not None:  # an explicit budget overrides per-kind lengths too
        for s in out:
            s.max_tokens = max_tokens
    return out


# ------------------------------------------------------------------ texts
def read_document(spec: dict[str, Any] | str) -> str:
    """A real text on this machine: the first path of ``spec["paths"]`` that exists (the
    licences every Debian ships), else a file of this repository; cut to ``chars``."""
    spec = {"paths": [spec]} if isinstance(spec, str) else spec
    candidates = [*spec.get("paths", []), str(REPO / "README.md")]
    for p in candidates:
        path = Path(p) if Path(p).is_absolute() else REPO / p
        if path.is_file():
            text = " ".join(path.read_text(errors="replace").split())
            start = int(spec.get("offset", 0))
            return text[start:start + int(spec.get("chars", 4000))]
    raise WorkloadError(f"none of {candidates} exists")


def _pick(rng: random.Random, items: list[str]) -> str:
    if not items:
        raise WorkloadError("a workload list is empty")
    return items[rng.randrange(len(items))]


def _zipf_index(rng: random.Random, n: int, skew: float) -> int:
    """Popular documents first: P(i) ~ 1 / (i + 1) ** skew."""
    weights = [1.0 / (i + 1) ** skew for i in range(n)]
    return rng.choices(range(n), weights)[0]


# -------------------------------------------------------------- generators
def _chat(p: dict[str, Any], rng: random.Random, start: float, budget: int) -> Session:
    lo, hi = p.get("turns", [1, 1])
    n_turns = rng.randint(int(lo), int(hi))
    turns = [_pick(rng, p["questions"])]
    turns += [_pick(rng, p.get("followups", p["questions"])) for _ in range(n_turns - 1)]
    return Session(start, p.get("system"), turns, budget, float(p.get("think_s", 0.0)),
                   tag=f"chat/{n_turns}")


def _doc_qa(p: dict[str, Any], rng: random.Random, start: float, budget: int) -> Session:
    docs = p["documents"]
    i = _zipf_index(rng, len(docs), float(p.get("skew", 1.0)))
    doc = read_document(docs[i])
    question = _pick(rng, p["questions"])
    user = p.get("template", "Document:\n{document}\n\nQuestion: {question}").format(
        document=doc, question=question)
    return Session(start, p.get("system"), [user], budget, tag=f"doc{i}")


def _mixed(p: dict[str, Any], rng: random.Random, start: float, budget: int) -> Session:
    if rng.random() < float(p.get("long_fraction", 0.2)):
        src = p["long"]
        text = read_document(src)
        lo, hi = src.get("excerpt_chars", [1000, 3000])
        size = rng.randint(int(lo), int(hi))
        # "from_start": every excerpt begins at the top, so long prompts share a prefix.
        at = 0 if src.get("from_start") else rng.randrange(max(1, len(text) - size))
        user = src.get("template", "Summarize:\n{excerpt}").format(excerpt=text[at:at + size])
        return Session(start, p.get("system"), [user], int(src.get("max_tokens", budget)),
                       tag="long")
    return Session(start, p.get("system"), [_pick(rng, p["questions"])], budget, tag="short")


GENERATORS = {"chat": _chat, "doc_qa": _doc_qa, "mixed": _mixed}
