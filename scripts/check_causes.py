"""Check that every preemption and eviction in a recording carries its cause.

    .venv/bin/python scripts/check_causes.py demo-out/demo.kvtrace

Prints the counts and one example cause per kind and tier; exits 1 if any
``seq_preempt`` or ``evict`` event has no ``cause`` (engine.events.causes).
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvscope.engine.events.causes import describe  # noqa: E402
from kvscope.engine.events.wire.recording import Recording  # noqa: E402


def main(path: str) -> int:
    counts, missing, example = Counter(), Counter(), {}
    with Recording(path) as rec:
        for batch in rec.batches():
            for ev in batch["events"]:
                kind = ev.get("kind")
                if kind not in ("seq_preempt", "evict"):
                    continue
                key = f"{kind} ({ev.get('mode') or ev.get('tier')})"
                counts[key] += 1
                if not isinstance(ev.get("cause"), dict):
                    missing[key] += 1
                example.setdefault(key, describe(ev.get("cause"), kind))
    for key in sorted(counts):
        print(f"{key}: {counts[key]} events, {missing[key]} without a cause; e.g. "
              f"{example[key]}")
    if not counts:
        print("no preemptions or evictions in this recording")
    return 1 if sum(missing.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
