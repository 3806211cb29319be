"""max_prefill_tokens_with_decodes: beside running decodes, prompts are computed in
arrival order, at most P tokens a step, each in even chunks (kvscope serve's default); an
engine with nothing decoding still takes a whole burst; tokens do not change."""

from __future__ import annotations

import pytest

from kvscope.engine import scheduler as scheduler_module
from kvscope.engine.sampling_params import SamplingParams
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


# a long prompt whose even chunks (three, under a cap of 8) leave room in their steps, then
# one that would fit there
LONG_THEN_SHORT = ["one two three four five six seven eight nine ten eleven twelve thirteen "
                   "fourteen fifteen sixteen seventeen", "Hi"]


@pytest.mark.parametrize("cap,arrivals", [(3, PROMPTS[1:]), (8, PROMPTS[1:]),
                                          (8, LONG_THEN_SHORT)], ids=["3", "8", "8-long-short"])
def test_prompts_beside_decodes_go_in_order_and_in_even_chunks(make_engine, reference, loaded,
                                                               cap, arrivals, monkeypatch):
    """Beside a decode, each step computes at most ``cap`` prompt tokens; the prompts go one
    after the other in arrival order (none starts while another is unfinished, not even a
    short one that would fit beside the long one's chunk), each in ceil(len / cap) chunks
    whose sizes differ by at most one token. (The cap's growth with the queue is off here:
    ``test_the_cap_grows_with_the_queue``.)"""
    monkeypatch.setattr(scheduler_module, "WAITING_PER_CAP", 10 ** 6)
    eng = make_engine(max_prefill_tokens_with_decodes=cap)
    # request 0 decodes through every step of the others' prefills
    eng.add_request("0", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=60,
                                                    ignore_eos=True))
    eng.step()
    for i, p in enumerate(arrivals, 1):
        eng.add_request(str(i), p, GREEDY)
    shapes, done = _step_shapes(eng)
    tok = loaded[1]
    lengths = {str(i): len(tok.encode(p)) for i, p in enumerate(arrivals, 1)}
    if arrivals is LONG_THEN_SHORT:  # the short one fits in a step of the long one's
        long_chunks = -(-lengths["1"] // cap)
        assert long_chunks >= 3 and lengths["2"] <= cap - -(-lengths["1"] // long_chunks)
    assert max(lengths.values()) > cap  # the test needs prompts that take several chunks
    chunks: dict[str, list[int]] = {rid: [] for rid in lengths}
    order: list[str] = []
    for step in shapes:
        prefill = [(rid, n) for rid, n, pre in step if pre]
        if sum(map(len, chunks.values())) and not any(
                sum(chunks[r]) < lengths[r] for r in lengths):
            assert not prefill  # every prompt is done
            continue
        assert ("0", 1, False) in step  # the decode goes on in every step
        assert 0 < sum(n for _, n in prefill) <= cap
        for rid, n in prefill:
            if not order or order[-1] != rid:
                assert not order or sum(chunks[order[-1]]) == lengths[order[-1]], \
                    f"{rid} started before {order[-1]} was prefilled"
                order.append(rid)
            chunks[rid].append(n)
    assert order == sorted(lengths)  # one prompt after the other, in arrival order
    for rid, sizes in chunks.items():
        assert sum(sizes) == lengths[rid]
        assert len(sizes) == -(-lengths[rid] // cap), sizes
        assert max(sizes) - min(sizes) <= 1, sizes
    assert done["0"].outputs[0].token_ids[:10] == reference[PROMPTS[0]]
    for i, p in enumerate(arrivals, 1):
        if p in reference:
            assert done[str(i)].outputs[0].token_ids == reference[p]


def test_a_small_step_budget_still_moves_the_prompt(make_engine):
    """When the step's token budget (max_num_batched_tokens less the decodes) is below the
    prompt's even chunk, the prompt goes on in budget-sized pieces every step: the budget
    cuts a chunk short, it does not hold the prompt back until the decodes finish."""
    eng = make_engine(max_prefill_tokens_with_decodes=8, max_num_batched_tokens=4)
    eng.add_request("0", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=60,
                                                    ignore_eos=True))
    while not eng.scheduler.running or not eng.scheduler.running[0].output_token_ids:
        eng.step()  # request 0's prompt, 4 tokens a step, until it decodes
    eng.add_request("1", LONG_THEN_SHORT[0], GREEDY)  # 17 tokens: even chunks of 6
    shapes, _ = _step_shapes(eng)
    pieces = [n for step in shapes for rid, n, pre in step if rid == "1" and pre]
    steps_with_decode = [step for step in shapes if ("0", 1, False) in step]
    assert pieces and max(pieces) <= 3 and sum(pieces) == 17
    assert all(any(rid == "1" and pre for rid, _, pre in step)
               for step in steps_with_decode[:len(pieces)])


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


def test_the_cap_grows_with_the_queue(make_engine):
    """Beside decodes a step computes at most P prompt tokens, plus P for every
    WAITING_PER_CAP requests waiting: with 9 queued the first step takes more than P; as
    the queue drains the steps shrink back to P."""
    from kvscope.engine.scheduler import WAITING_PER_CAP

    cap = 4
    eng = make_engine(max_prefill_tokens_with_decodes=cap)
    eng.add_request("0", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=80,
                                                    ignore_eos=True))
    eng.step()
    for i in range(1, 10):
        eng.add_request(str(i), PROMPTS[i % len(PROMPTS)], SamplingParams(
            temperature=0.0, max_tokens=2, ignore_eos=True))
    waiting_before, prompt_tokens = [], []
    schedule = eng.scheduler.schedule

    def spy():
        waiting_before.append(len(eng.scheduler.waiting))
        out = schedule()
        prompt_tokens.append(sum(s.num_new_tokens for s in out.scheduled
                                 if not (s.seq.output_token_ids and s.num_new_tokens == 1)))
        return out

    eng.scheduler.schedule = spy
    run_all(eng)
    assert waiting_before[0] == 9 and prompt_tokens[0] > cap
    for waiting, tokens in zip(waiting_before, prompt_tokens, strict=True):
        assert tokens <= cap * (1 + waiting // WAITING_PER_CAP)
    assert max(prompt_tokens) > cap  # the queue did raise it
    late = [t for w, t in zip(waiting_before, prompt_tokens, strict=True) if w < WAITING_PER_CAP]
    assert late and max(late) <= cap
