"""max_prefill_tokens_with_decodes: beside running decodes, prompts are computed in
arrival order, at most P tokens a step (kvscope serve's default); an engine with nothing
decoding still takes a whole burst; tokens do not change."""

from __future__ import annotations

import pytest

from tests.engine.conftest import GREEDY, PROMPTS, run_all


def _step_shapes(engine) -> tuple[list[list[tuple[str, int, bool]]], dict]:
    """Per step until idle: (request id, tokens, prefill) of each scheduled sequence; and
    the final outputs."""
    shapes = []
    schedule = engine.scheduler.schedule

    def spy():
        out = schedule()
        shapes.append([(s.seq.request_id, s.num_new_tokens,
                        not (s.seq.output_token_ids and s.num_new_tokens == 1))
                       for s in out.scheduled])
        return out
    engine.scheduler.schedule = spy
    done = run_all(engine)
    engine.scheduler.schedule = schedule
    return shapes, done


def test_burst_on_idle_engine_is_one_step(make_engine):
    eng = make_engine(max_prefill_tokens_with_decodes=3)
    for i, p in enumerate(PROMPTS):
        eng.add_request(str(i), p, GREEDY)
    shapes, _ = _step_shapes(eng)
    assert sorted(rid for rid, _, pre in shapes[0] if pre) == ["0", "1", "2", "3"]


@pytest.mark.parametrize("cap", [3, 8])
def test_prompts_beside_decodes_go_in_order_and_in_chunks(make_engine, reference, loaded,
                                                          cap):
    eng = make_engine(max_prefill_tokens_with_decodes=cap)
    eng.add_request("0", PROMPTS[0], GREEDY)
    eng.step()  # request 0 now decodes
    for i, p in enumerate(PROMPTS[1:], 1):
        eng.add_request(str(i), p, GREEDY)
    shapes, done = _step_shapes(eng)
    tok = loaded[1]
    left = sum(len(tok.encode(p)) for p in PROMPTS[1:])
    order = []
    for step in shapes:
        prefill = [(rid, n) for rid, n, pre in step if pre]
        if not left:
            assert not prefill
            continue
        assert ("0", 1, False) in step  # the decode goes on in every step
        assert sum(n for _, n in prefill) == min(cap, left)
        left -= sum(n for _, n in prefill)
        order += [rid for rid, _ in prefill if not order or order[-1] != rid]
    assert order == ["1", "2", "3"]  # one prompt after the other, in arrival order
    for i, p in enumerate(PROMPTS):
        assert done[str(i)].outputs[0].token_ids == reference[p]


def test_no_cap_admits_everyone_beside_decodes(make_engine):
    eng = make_engine()  # the engine's default: 0, no cap (vLLM's behaviour)
    eng.add_request("0", PROMPTS[0], GREEDY)
    eng.step()
    for i, p in enumerate(PROMPTS[1:], 1):
        eng.add_request(str(i), p, GREEDY)
    shapes, _ = _step_shapes(eng)
    assert sorted(rid for rid, _, pre in shapes[0] if pre) == ["1", "2", "3"]


def test_cap_must_not_be_negative(make_engine):
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decodes"):
        make_engine(max_prefill_tokens_with_decodes=-1)
