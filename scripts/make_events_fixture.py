"""Write an events-recording fixture with the CURRENT writer (tests/events/fixtures).

    .venv/bin/python scripts/make_events_fixture.py tests/events/fixtures/v2_synthetic

writes NAME.kvtrace (an EventStream recording of the seeded synthetic workload, with
keyframes every 40 steps) and NAME.json (the protocol version, the seed, and per step a
digest of the generator's own ground-truth state). Run once per protocol version, before
the writer changes, so the next release's reader is tested on a file the old one wrote.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from kvscope.engine.bench.synthetic import SyntheticCache
from kvscope.engine.events import PROTOCOL_VERSION
from kvscope.engine.events.wire import EventStream

SEED, STEPS = 32, 120


def digest(canon: dict) -> str:
    """sha256 of the canonical state as sorted JSON (block_formats normalised to {})."""
    canon = json.loads(json.dumps(canon))
    for t in canon["tiers"].values():
        t["block_formats"] = t.get("block_formats") or {}
    return hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()[:16]


def main(stem: str) -> None:
    gen, digests = SyntheticCache(seed=SEED), {}
    with EventStream(record_path=f"{stem}.kvtrace", header={"fixture": "synthetic"},
                     snapshot_fn=gen.canonical, keyframe_every_steps=40,
                     keyframe_every_s=1e9) as stream:
        for step in range(STEPS):
            stats = gen.step(stream.sink)
            stream.end_step(step, stats)
            digests[str(step)] = digest(gen.canonical())
            stream.wait_idle()
    Path(f"{stem}.json").write_text(json.dumps(
        {"protocol": PROTOCOL_VERSION, "seed": SEED, "digests": digests}, indent=0) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
