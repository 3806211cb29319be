"""The inspector shows a hybrid cache's window group (engine.cache.window_group): its own
block map beside the gpu tier's, and a selected sequence's window blocks lit there."""

from __future__ import annotations

import os

from kvscope.engine.cache import KVCacheManager
from kvscope.engine.events import KVState
from kvscope.engine.events import schema as S
from kvscope.engine.events.sink import ListSink


def _hybrid_state() -> KVState:
    """Two sequences decoding past a window of 8 tokens, the second sharing the first's
    prefix (prefix caching: a hit in both groups): the window group has released their
    early blocks (indexed ones stay cached) while the full-attention tables keep every
    block; then "b" is swapped out, its window blocks to the window group's host pool."""
    sink = ListSink()
    m = KVCacheManager(48, 4, window=8, num_window_blocks=16, sink=sink, num_cpu_blocks=24,
                       num_window_cpu_blocks=8)
    for sid, n in (("a", 14), ("b", 9)):
        m.add_sequence(sid, list(range(n)))
        k = m.match_prefix(sid)
        m.allocate_slots(sid, n - k)
        m.start(sid)
    for t in range(20):
        for sid in ("a", "b"):
            m.allocate_slots(sid, 1)
            m.append_token_ids(sid, [t])
    assert m.preempt("b", "swap") == "swap"
    m.flush_step_events()
    st = KVState()
    st.apply({"v": 2, "step": 1, "events": sink.drain()})
    assert st.canonical() == m.snapshot()
    return st


def test_block_map_draws_the_window_group_and_lights_a_sequence_there(window, qapp):
    st = _hybrid_state()
    window.model.set_state(st)
    window.model.select_seq("a")
    for _ in range(3):
        qapp.processEvents()
    panels = window.block_map.panels
    assert set(panels) >= {"gpu", "gpu/1"}
    assert "window group" in panels["gpu/1"].title.text
    lit = window.model.highlighted_blocks("gpu/1")
    assert lit == st.seqs["a"].group_tables[1] and 0 < len(lit) <= 8 // 4 + 1
    assert window.model.highlighted_blocks("gpu") == st.seqs["a"].block_table
    assert st.seqs["b"].hit_tokens == 8  # its window blocks of those 8 tokens were shared
    assert S.BLOCK_CACHED in set(st.block_codes("gpu/1").tolist())  # released, indexed
    # the swapped sequence's window blocks, lit on the window group's host pool
    window.model.select_seq("b")
    for _ in range(3):
        qapp.processEvents()
    assert "CPU window group" in panels["cpu/1"].title.text
    lit = window.model.highlighted_blocks("cpu/1")
    assert lit == st.seqs["b"].group_tables[1] and 0 < len(lit) <= 8 // 4 + 1
    assert window.model.highlighted_blocks("gpu/1") == []
    from kvscope.inspector import palette as P

    assert P.state_colours("cpu/1", "auto")[S.BLOCK_USED] == P.SWAPPED  # as the cpu tier's
    shot = os.environ.get("KVSCOPE_SCREENSHOT_DIR")
    if shot:  # for a person to look at (never inside the repository)
        window.grab().save(os.path.join(shot, "hybrid_groups.png"))


def test_window_groups_sit_under_their_tier_and_count_in_the_legend(window, qapp):
    """Four maps (gpu, gpu/1, cpu, cpu/1) in two columns, each window group under its
    tier's map (in one row they ran off a 1600-pixel window's right edge), and the legend
    counts a window group's blocks with its tier's: "swapped out" is b's group-0 blocks on
    the cpu tier plus its window blocks on cpu/1."""
    st = _hybrid_state()
    window.model.set_state(st)
    for _ in range(3):
        qapp.processEvents()
    panels = window.block_map.panels

    positions = {name: window.block_map.canvas.ci.items[panels[name].view]
                 for name in ("gpu", "gpu/1", "cpu", "cpu/1")}
    (gpu_row, gpu_col), (win_row, win_col) = positions["gpu"][0], positions["gpu/1"][0]
    assert win_col == gpu_col and win_row > gpu_row
    assert positions["cpu/1"][0][1] == positions["cpu"][0][1] != gpu_col
    swapped = sum(int((st.block_codes(t) == S.BLOCK_USED).sum()) for t in ("cpu", "cpu/1"))
    texts = [lab.text() for lab in window.block_map.legend.labels]
    entry = next(t for t in texts if "swapped out" in t)
    assert swapped == len(st.seqs["b"].block_table) + len(st.seqs["b"].group_tables[1])
    assert entry.endswith(f"{swapped:,}</span>")
