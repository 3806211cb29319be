"""A state whose step is the protocol's largest (2**63 - 1, a valid int64) reaches the
views whole: the cursor signal carried it as a C int, and shiboken warned "Overflow:
Value 9223372036854775807 exceeds limits of type [signed] int" (issue 49)."""

from __future__ import annotations

import warnings

from kvscope.engine.events import KVState

BIG = (1 << 63) - 1


def test_the_largest_step_reaches_the_cursor_without_an_overflow(window):  # noqa: ANN001
    st = KVState()
    st.apply({"v": 1, "step": 0, "events": [
        {"kind": "tier_init", "tier": "gpu", "num_blocks": 16, "block_size": 16}]})
    snap = st.snapshot()
    snap["step"] = BIG
    got: list[int] = []
    window.model.cursor_changed.connect(got.append)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        window.model.set_state(KVState.from_snapshot(snap))
    assert not [w for w in caught if "Overflow" in str(w.message)]
    assert got == [BIG]
