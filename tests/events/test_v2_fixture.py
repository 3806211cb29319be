"""A protocol-2 recording written by the protocol-2 writer replays and seeks identically:
the fixture the next protocol version's reader must keep opening."""

from __future__ import annotations

import json
from pathlib import Path

from kvscope.engine.events import KVState
from kvscope.engine.events.wire.recording import Recording

FIXTURES = Path(__file__).parent / "fixtures"


def _digest(canon: dict) -> str:
    import sys
    sys.path.insert(0, str(Path(__file__).parents[2] / "scripts"))
    from make_events_fixture import digest
    return digest(dict(canon))


def test_version_2_recording_replays_identically():
    """A file written by the protocol-2 writer (scripts/make_events_fixture.py), with the
    digest of the generator's true state after every step."""
    meta = json.loads((FIXTURES / "v2_synthetic.json").read_text())
    digests = meta["digests"]
    with Recording(FIXTURES / "v2_synthetic.kvtrace") as rec:
        assert rec.header["protocol"] == 2 == meta["protocol"]
        assert rec.steps == [int(s) for s in digests]
        st = KVState()
        for batch in rec:
            assert batch["v"] == 2 and isinstance(batch["events"], list)
            st.apply(batch)
            assert _digest(st.canonical()) == digests[str(batch["step"])]
        for step in (0, 39, 40, 77, 119):  # seeks: v2 keyframes + v2 deltas
            assert _digest(rec.state_at(step).canonical()) == digests[str(step)]
