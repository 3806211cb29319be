"""Bad requests are refused at add_request with a clear error, change nothing, and the
engine keeps serving everyone else; aborts free blocks; per-request metrics are filled."""

from __future__ import annotations

import pytest

from kvscope.engine.sampling_params import RequestOutputKind, SamplingParams
from tests.engine.conftest import run_all

OK = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize(
    ("prompt", "params", "error", "match"),
    [
        ("", OK, ValueError, "empty"),
        ({"prompt_token_ids": []}, OK, ValueError, "empty"),
        ({"prompt_token_ids": [1] * 200}, OK, ValueError, "max_model_len"),
        ({"prompt_token_ids": [10**9]}, OK, ValueError, "must lie in"),
        ("hi", {"max_tokens": 0}, ValueError, "max_tokens"),
        ("hi", {"n": 0}, ValueError, "n"),
        ("hi", {"temprature": 0.5}, TypeError, "temprature"),
        (3.14, OK, TypeError, "a prompt is a str"),
        ("hi", "greedy", TypeError, "SamplingParams"),
    ],
)
def test_bad_request_refused_and_others_served(make_engine, prompt, params, error, match):
    eng = make_engine(max_model_len=128, num_gpu_blocks=64)
    eng.add_request("good", "The capital of France is", OK)
    before = eng.kv_state()
    with pytest.raises(error, match=match):
        eng.add_request("bad", prompt, params)
    assert eng.kv_state() == before
    out = run_all(eng)
    assert set(out) == {"good"} and len(out["good"].outputs[0].token_ids) == 4


def test_duplicate_id_and_too_big_for_cache(make_engine):
    eng = make_engine(num_gpu_blocks=4, block_size=4, max_model_len=256)
    eng.add_request("a", "hello there", OK)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("a", "again", OK)
    with pytest.raises(ValueError, match="whole cache"):
        eng.add_request("b", {"prompt_token_ids": list(range(100, 140))}, OK)
    assert set(run_all(eng)) == {"a"}


def test_abort_frees_blocks(make_engine):
    eng = make_engine(num_gpu_blocks=64, block_size=4)
    eng.add_request("x", "Tell me a long story about a dragon", SamplingParams(max_tokens=50))
    eng.add_request("y", "Count: 1, 2, 3,", OK)
    eng.step()
    eng.step()
    assert eng.cache.block_table("x")
    eng.abort_request("x")
    assert "x" not in eng.kv_state()["seqs"]
    out = run_all(eng)
    assert set(out) == {"y"}
    eng.cache.check_invariants()
    assert eng.cache.metrics()["tiers"]["gpu"]["used"] == 0


def test_request_metrics(make_engine):
    eng = make_engine()
    eng.add_request("m", "The capital of France is", OK)
    m = run_all(eng)["m"].metrics
    assert m.num_prompt_tokens > 0 and m.num_generation_tokens == 4
    assert m.time_to_first_token is not None and m.time_to_first_token > 0
    assert m.time_per_output_token is not None and m.time_per_output_token > 0
    assert m.num_preemptions == 0


def test_output_kinds(make_engine):
    """CUMULATIVE: an output every step, its tokens frozen as they were; FINAL_ONLY: one
    output, when the request finishes, holding the same tokens."""
    eng = make_engine()
    eng.add_request("c", {"prompt_token_ids": [5, 6, 7, 8]},
                    SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    eng.add_request("f", {"prompt_token_ids": [5, 6, 7, 8]},
                    SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                   output_kind=RequestOutputKind.FINAL_ONLY))
    seen: dict[str, list] = {"c": [], "f": []}
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id].append(out)
    assert [len(o.outputs[0].token_ids) for o in seen["c"]] == [1, 2, 3, 4, 5]
    assert [o.finished for o in seen["f"]] == [True]
    assert seen["f"][0].outputs[0].token_ids == seen["c"][-1].outputs[0].token_ids


def test_token_ids_between_is_a_slice_of_all_token_ids():
    from kvscope.engine.sequence import Sequence

    seq = Sequence("s", "r", 0, [1, 2, 3], None, output_token_ids=[4, 5])
    for start in range(6):
        for end in range(start, 7):
            assert seq.token_ids_between(start, end) == seq.all_token_ids[start:end]
