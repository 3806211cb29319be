"""The block map's colour modes (state, owner, ref count, format, age) read the vectorised
mirror's columns correctly, and the map redraws only tiers that changed."""

from __future__ import annotations

import numpy as np
import pytest

from kvscope.engine.events import KVState
from kvscope.engine.events import schema as S
from kvscope.inspector import palette as P
from kvscope.inspector.model import InspectorModel
from kvscope.inspector.views.block_map import (
    MODES,
    BlockMapView,
    cell_codes,
    mode_codes,
    state_codes,
)


def small_state() -> KVState:
    st = KVState()
    st.apply({"v": 2, "step": 0, "events": [
        {"kind": "tier_init", "tier": "gpu", "num_blocks": 8, "block_size": 4,
         "format": "fp16"},
        {"kind": "seq_add", "seq": "a"}, {"kind": "seq_add", "seq": "b"},
        {"kind": "alloc", "tier": "gpu", "seq": "a", "blocks": [1, 2]},
        {"kind": "store", "tier": "gpu", "blocks": [1, 2], "hashes": [11, 12]},
        {"kind": "hit", "tier": "gpu", "seq": "b", "blocks": [1, 2], "tokens": 8},
        {"kind": "alloc", "tier": "gpu", "seq": "b", "blocks": [3]},
        {"kind": "seq_add", "seq": "c"},
        {"kind": "alloc", "tier": "gpu", "seq": "c", "blocks": [5]},
        {"kind": "store", "tier": "gpu", "blocks": [5], "hashes": [15]},
        {"kind": "free", "tier": "gpu", "seq": "c", "blocks": [5]},
        {"kind": "seq_finish", "seq": "c", "reason": "stop"}]})
    st.apply({"v": 2, "step": 40, "events": [
        # a leaves: blocks 1 and 2 stay held by b only (taken by a: orphans to resolve)
        {"kind": "free", "tier": "gpu", "seq": "a", "blocks": [1, 2]},
        {"kind": "seq_finish", "seq": "a", "reason": "stop"},
        {"kind": "quantize", "tier": "gpu", "blocks": [3], "format": "int8"}]})
    return st


def test_every_mode_reads_the_columns():
    st = small_state()
    b_slot = P.OWNER_BASE + P.owner_index("b")
    # state mode: block 3, demoted to int8, reads as "in use (demoted)"
    assert mode_codes(st, "gpu", "state").tolist() == [0, 2, 2, P.CODE_DEMOTED_USED, 0, 1, 0, 0]
    assert mode_codes(st, "gpu", "owner").tolist() == [0, b_slot, b_slot, b_slot, 0, 1, 0, 0]
    assert mode_codes(st, "gpu", "ref count").tolist() == [
        0, P.RAMP_BASE, P.RAMP_BASE, P.RAMP_BASE, 0, S.BLOCK_CACHED, 0, 0]
    assert mode_codes(st, "gpu", "format").tolist() == [
        0, P.FORMAT_BASE, P.FORMAT_BASE, P.FORMAT_BASE + 1, 0, P.FORMAT_BASE, 0, 0]
    age = mode_codes(st, "gpu", "age")
    newest, oldest = P.RAMP_BASE + P.RAMP_LEN - 1, P.RAMP_BASE
    assert age[3] == newest  # quantized at step 40 (now)
    assert age[1] == newest and age[5] < newest  # freed now vs. 40 steps ago
    assert age[0] == oldest  # never touched
    for mode in MODES:  # every code has a colour in the one LUT
        assert mode_codes(st, "gpu", mode).max() < P.LUT_SIZE


def test_ref_counts_cap_at_the_top_of_the_ramp():
    st = KVState()
    events = [{"kind": "tier_init", "tier": "gpu", "num_blocks": 4, "block_size": 4}]
    for i in range(20):
        events.append({"kind": "seq_add", "seq": f"s{i}"})
        events.append({"kind": "fork" if i else "alloc", "tier": "gpu", "seq": f"s{i}",
                       "blocks": [2], **({"parent": "s0"} if i else {})})
    st.apply({"v": 2, "step": 0, "events": events})
    assert mode_codes(st, "gpu", "ref count")[2] == P.RAMP_BASE + P.RAMP_LEN - 2


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown colour mode"):
        mode_codes(small_state(), "gpu", "rainbow")


def test_map_redraws_only_changed_tiers(qtbot):  # noqa: ANN001
    model = InspectorModel()
    view = BlockMapView(model)
    qtbot.addWidget(view)
    st = small_state()
    st.apply({"v": 2, "step": 41, "events": [
        {"kind": "tier_init", "tier": "cpu", "num_blocks": 16, "block_size": 4}]})
    model.set_state(st.clone())  # st is the mirror; the model gets frames (clones)
    draws: list[str] = []
    for name, panel in view.panels.items():
        real, real_cells = panel.draw, panel.draw_cells
        panel.draw = lambda name=name, real=real: (draws.append(name), real())
        panel.draw_cells = lambda blocks, name=name, real=real_cells: (
            draws.append(name), real(blocks))
    view.refresh()
    assert draws == []  # nothing changed since set_state drew it
    st.apply({"v": 2, "step": 42, "events": [
        {"kind": "seq_add", "seq": "d"},
        {"kind": "alloc", "tier": "gpu", "seq": "d", "blocks": [6]}]})
    model.set_state(st.clone(reuse=model.state))  # as the live source hands frames over
    assert draws == ["gpu"]  # the host tier was shared, not redrawn
    assert view.cells("gpu")[6] == S.BLOCK_USED
    view.colour_by.setCurrentText("ref count")
    assert sorted(draws) == ["cpu", "gpu", "gpu"]
    assert np.array_equal(view.cells("cpu"), np.zeros(16, dtype=np.uint8))
    for step in (43, 44):  # only the changed blocks are recomputed, same result as a full
        st.apply({"v": 2, "step": step, "events": [
            {"kind": "seq_add", "seq": f"e{step}", "parent": "d"},
            {"kind": "fork", "tier": "gpu", "seq": f"e{step}", "parent": "d", "blocks": [6]}]})
        model.set_state(st.clone(reuse=model.state))
        assert np.array_equal(view.cells("gpu"), mode_codes(st, "gpu", "ref count"))
    assert view.cells("gpu")[6] == P.RAMP_BASE + 2  # ref 3
    assert view.legend.text().count("■") >= 4


def test_age_mode_frames_update_incrementally_and_exactly(qtbot):  # noqa: ANN001
    """Each later step recomputes only changed blocks and bucket crossings; the map
    always equals a full recomputation."""
    model = InspectorModel()
    view = BlockMapView(model)
    qtbot.addWidget(view)
    st = KVState()
    st.apply({"v": 2, "step": 0, "events": [
        {"kind": "tier_init", "tier": "gpu", "num_blocks": 64, "block_size": 4},
        {"kind": "tier_init", "tier": "cpu", "num_blocks": 32, "block_size": 4},
        {"kind": "offload", "src": [0, 1], "dst": [3, 4], "hashes": [1, 2]}]})
    model.set_state(st.clone())
    view.colour_by.setCurrentText("age")
    full_draws = []
    for panel in view.panels.values():
        real = panel.draw
        panel.draw = lambda real=real: (full_draws.append(1), real())
    for step in range(1, 70):
        events = [{"kind": "seq_add", "seq": f"s{step}"},
                  {"kind": "alloc", "tier": "gpu", "seq": f"s{step}", "blocks": [step % 64]},
                  {"kind": "free", "tier": "gpu", "seq": f"s{step}", "blocks": [step % 64]},
                  {"kind": "seq_finish", "seq": f"s{step}", "reason": "stop"}]
        st.apply({"v": 2, "step": step + (step > 60) * 5, "events": events})  # then jumps
        model.set_state(st.clone(reuse=model.state))
        for tier in ("gpu", "cpu"):
            assert np.array_equal(view.cells(tier), mode_codes(st, tier, "age")), (step, tier)
    assert full_draws == []  # every frame was incremental


@pytest.mark.parametrize("fmt", S.QUANTIZED_KV_FORMATS)
def test_every_quantized_format_gets_the_quantized_hues(fmt: str):
    colours, labels = P.state_colours("gpu", fmt), P.state_labels("gpu", fmt)
    assert colours[S.BLOCK_USED] == P.QUANT_USED and colours[S.BLOCK_SHARED] == P.QUANT_SHARED
    assert labels[S.BLOCK_USED] == f"in use ({fmt})"
    assert P.state_colours("gpu", "auto")[S.BLOCK_USED] == P.USED


def _reference_cells(model: InspectorModel, twin: KVState, tier: str, mode: str) -> np.ndarray:
    """The map's cells drawn from scratch: ``cell_codes`` of a copy of ``twin`` (a second
    mirror of the same stream: cloning the live mirror itself would end its incremental
    hand-over), with the model's selection read against that copy."""
    ref = InspectorModel()
    ref.state = twin.clone()
    ref.selected_seq, ref.selected_block = model.selected_seq, model.selected_block
    ref.highlight = model.highlight
    sel = model.selected_block
    return cell_codes(ref.state, tier, mode=mode, highlight=ref.highlighted_blocks(tier),
                      selected=sel[1] if sel is not None and sel[0] == tier else None)


def _quantize_some(st: KVState, step: int) -> list[dict]:
    """A ``quantize`` of up to 4 held GPU blocks (some steps): the demoted codes."""
    if step % 25 or "gpu" not in st.tiers:
        return []
    held = np.flatnonzero(st.tiers["gpu"].ref > 0)[:: 7][:4].tolist()
    return [{"kind": "quantize", "tier": "gpu", "blocks": held, "format": "int8"}] if held else []


@pytest.mark.parametrize("stream", ["events", "columns"])
def test_incremental_frames_equal_a_full_redraw(qtbot, stream: str):  # noqa: ANN001
    """The live path (one step applied, ``clone(reuse=)``, the map redraws only what
    changed) draws exactly what a full recompute of the frame draws: after every step of
    a random stream, in every colour mode, with a sequence, a block or a highlight
    selected or nothing; and it redraws whole tiers only when the mode or the dimming
    switches."""
    import random

    from kvscope.engine.bench.event_workloads import bulk_batches
    from kvscope.engine.events.wire import codec as C
    from tests.inspector.batches import synthetic_batches

    if stream == "events":
        batches = synthetic_batches(160, seed=5, gpu_blocks=512, cpu_blocks=128,
                                    max_running=12, arrival_rate=0.9)
    else:  # bulk steps as the wire carries them: decoded protocol-3 columns
        codec = C.Codec()
        batches = [codec.decode(codec.encode(C.make_batch("e", i + 1, i, float(i), ev, s)))
                   for i, (ev, s) in enumerate(bulk_batches(
                       60, blocks_per_seq=64, live=6, num_blocks=2048))]
        assert sum("columns" in b for b in batches) > 30
    model = InspectorModel()
    view = BlockMapView(model)
    qtbot.addWidget(view)
    mirror, twin = KVState(), KVState()
    rng = random.Random(7)
    full: list[str] = []
    partial: list[int] = []
    seen: set[tuple[str, str]] = set()  # (mode, what is selected) of the frames checked
    for i, batch in enumerate(batches):
        if stream == "events":
            batch = {**batch, "events": batch["events"] + _quantize_some(mirror, i)}
        mirror.apply(batch)
        twin.apply(batch)
        if i % 7 == 3:  # every mode in turn, a few frames each
            view.colour_by.setCurrentText(MODES[(i // 7) % len(MODES)])
        if i > 2 and rng.random() < 0.3:  # a new selection, often straight from another
            pick, seqs = rng.random(), sorted(mirror.seqs)
            if pick < 0.4 and seqs:
                model.set_highlight(None)
                model.select_seq(rng.choice(seqs))
            elif pick < 0.6:
                model.set_highlight(None)
                model.select_seq(None)
                model.select_block("gpu", rng.randrange(mirror.tiers["gpu"].num_blocks))
            elif pick < 0.8:
                model.set_highlight({"gpu": rng.sample(
                    range(mirror.tiers["gpu"].num_blocks), 5)})
            elif pick < 0.9:  # under a highlight: the selected cell moves, nothing else
                model.select_block("gpu", rng.randrange(mirror.tiers["gpu"].num_blocks))
            else:
                model.set_highlight(None)
                model.select_seq(None)
                model.select_block(None)
        for n, p in view.panels.items():  # count whole-tier redraws of this frame
            if getattr(p, "_counted", False):
                continue
            real, real_cells = p.draw, p.draw_cells
            p.draw = lambda n=n, real=real: (full.append(n), real())
            p.draw_cells = lambda blocks, real=real_cells: (partial.append(1), real(blocks))
            p._counted = True
        full.clear()
        before = {n: (id(p), p.lit is None, view.mode,
                      id(model.state.tiers.get(n))) for n, p in view.panels.items()}
        model.set_state(mirror.clone(reuse=model.state if i else None))
        seen.add((view.mode, "highlight" if model.highlight else "seq" if model.selected_seq
                  else "block" if model.selected_block else "none"))
        for tier in mirror.tiers:
            assert np.array_equal(view.cells(tier), _reference_cells(
                model, twin, tier, view.mode)), (i, tier, view.mode)
            assert np.array_equal(view.panels[tier].counts, np.bincount(  # the legend's
                state_codes(twin, tier), minlength=8)), (i, tier)
            was = before.get(tier)
            if tier in full and was is not None and i > 2:
                p = view.panels[tier]
                assert (was[0] != id(p) or was[1] != (p.lit is None) or was[2] != view.mode
                        or was[3] != id(model.state.tiers[tier])), (i, tier)
    assert {m for m, _ in seen} == set(MODES)
    assert len(partial) > len(batches) // 2  # most frames took the incremental path
    assert {w for _, w in seen} == {"none", "seq", "block", "highlight"}
    if stream == "events":
        assert len(mirror.tiers["gpu"].format_names) > 1  # the quantize steps applied
