"""max_num_prefill_seqs: arrivals join a decoding batch one prefill per step (kvscope
serve's default), an idle engine still takes a whole burst, and tokens do not change."""

from __future__ import annotations

import pytest

from tests.engine.conftest import GREEDY, PROMPTS, run_all


def _step_shapes(engine) -> tuple[list[tuple[int, int]], dict]:
    """(sequences prefilling, sequences decoding) of each step until idle, and the outputs."""
    shapes = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        shapes.append((sum(s.seq.is_prefill for s in out.scheduled),
                       sum(not s.seq.is_prefill for s in out.scheduled)))
        return out
    engine.scheduler.schedule = spy
    done = run_all(engine)
    engine.scheduler.schedule = schedule
    return shapes, done


def test_burst_on_idle_engine_is_one_step(make_engine):
    eng = make_engine(max_num_prefill_seqs=1)
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, GREEDY)
    shapes, _ = _step_shapes(eng)
    assert shapes[0] == (len(PROMPTS), 0)  # nothing decodes yet: no cap


@pytest.mark.parametrize("cap", [1, 2])
def test_arrivals_beside_decodes_join_cap_per_step(make_engine, reference, cap):
    eng = make_engine(max_num_prefill_seqs=cap)
    eng.add_request("0", PROMPTS[0], GREEDY)
    eng.step()  # request 0 now decodes
    for i, p in enumerate(PROMPTS[1:], 1):
        eng.add_request(str(i), p, GREEDY)
    shapes, done = _step_shapes(eng)
    expected = []
    left = len(PROMPTS) - 1
    while left:
        expected.append(min(cap, left))
        left -= expected[-1]
    assert [pre for pre, _ in shapes[:len(expected)]] == expected
    assert all(dec >= 1 for _, dec in shapes[:len(expected)])
    for i, p in enumerate(PROMPTS):
        assert done[str(i)].outputs[0].token_ids == reference[p]


def test_no_cap_admits_everyone_beside_decodes(make_engine):
    eng = make_engine()  # the engine's default: 0, no cap (vLLM's behaviour)
    eng.add_request("0", PROMPTS[0], GREEDY)
    eng.step()
    for i, p in enumerate(PROMPTS[1:], 1):
        eng.add_request(str(i), p, GREEDY)
    shapes, _ = _step_shapes(eng)
    assert shapes[0] == (len(PROMPTS) - 1, 1)


def test_cap_must_not_be_negative(make_engine):
    with pytest.raises(ValueError, match="max_num_prefill_seqs"):
        make_engine(max_num_prefill_seqs=-1)
