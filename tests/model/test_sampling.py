"""SamplingParams validation and the batched sampler (no model needed)."""

from __future__ import annotations

import pytest
import torch

from kvscope.engine.sampling_ops import (
    greedy_batch,
    make_generator,
    sample,
    sample_batch,
    top_logprobs,
    top_logprobs_batch,
)
from kvscope.engine.sampling_params import RequestOutputKind, SamplingParams


def test_defaults_are_vllms():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, 0, 0.0,
                                                                              16)
    assert p.stop == [] and p.stop_token_ids == [] and p.seed is None and not p.ignore_eos


def test_output_kind_takes_vllms_values():
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY


def test_stop_accepts_str_or_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]


def test_unknown_argument_is_named():
    with pytest.raises(TypeError, match="unknown argument.*max_new_tokens.*accepted: n, temp"):
        SamplingParams(max_new_tokens=5)


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 0}, "n must be"), ({"max_tokens": 0}, "max_tokens must be"),
    ({"temperature": -0.1}, "temperature must be >= 0"), ({"top_p": 0.0}, r"top_p must be in"),
    ({"top_p": 1.5}, "top_p must be in"), ({"top_k": -2}, "top_k must be"),
    ({"top_k": 1.5}, "top_k must be an int"), ({"min_p": 2.0}, "min_p must be in"),
    ({"seed": "x"}, "seed must be an int"), ({"stop": [""]}, "stop must be"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"logprobs": -1}, "logprobs must be"),
    ({"max_tokens": True}, "max_tokens must be"),
    ({"output_kind": 1}, "output_kind must be one of"),  # vLLM's DELTA: not supported
    ({"output_kind": True}, "output_kind must be one of"),
])
def test_invalid_values_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def _logits(rows: int = 1, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_logprob_is_raw():
    logits = _logits(3)
    ids, logprobs = sample(logits, [SamplingParams(temperature=0)] * 3, [None] * 3)
    assert ids.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).max(-1).values)


def test_seeded_row_is_independent_of_batch_company():
    """The same request (seed 7) gets the same samples alone and amid other requests."""
    logits = _logits(4, seed=1)
    p = SamplingParams(temperature=0.8, seed=7)
    alone_gen = make_generator(7, 0, "cpu")
    alone = [int(sample(logits[2:3], [p], [alone_gen])[0]) for _ in range(20)]
    gens = [make_generator(s, 0, "cpu") for s in (1, 2, 7, 3)]
    others = [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0),
              p, SamplingParams(temperature=2.0, top_p=0.5)]
    batched = [int(sample(logits, others, gens)[0][2]) for _ in range(20)]
    assert alone == batched
    assert len(set(alone)) > 1  # it really sampled


def test_non_greedy_needs_a_generator():
    with pytest.raises(ValueError, match="needs a torch.Generator"):
        sample(_logits(), [SamplingParams(temperature=1.0)], [None])


def _draws(logits_row: torch.Tensor, params: SamplingParams, count: int) -> torch.Tensor:
    gen = make_generator(0, 0, "cpu")
    return torch.tensor([int(sample(logits_row[None], [params], [gen])[0])
                         for _ in range(count)])


def test_top_k_and_min_p_restrict_support():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0, -1.0])
    assert set(_draws(logits, SamplingParams(top_k=2), 300).tolist()) == {0, 1}
    # min_p=0.3: keep tokens with p >= 0.3 * p_max, i.e. logit >= 4 + ln(0.3) = 2.80
    assert set(_draws(logits, SamplingParams(min_p=0.3), 300).tolist()) == {0, 1}


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert set(_draws(logits, SamplingParams(top_p=0.7), 300).tolist()) == {0, 1}
    assert set(_draws(logits, SamplingParams(top_p=0.1), 50).tolist()) == {0}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.6, 0.3, 0.1])
    draws = _draws(probs.log(), SamplingParams(temperature=1.0), 3000)
    freq = torch.bincount(draws, minlength=3).float() / 3000
    assert (freq - probs).abs().max() < 0.04  # ~4.7 standard deviations for p=0.6


def test_top_logprobs():
    logits = _logits(2)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0)]
    ids, _ = sample(logits, params, [None, None])
    tops = top_logprobs(logits, params, ids)
    assert tops[1] is None and len(tops[0]) == 3 and int(ids[0]) in tops[0]


def test_greedy_batch_is_what_sample_returns_for_greedy_rows():
    """The engine's batched greedy path: same tokens (first index on ties) and the same raw
    logprobs as sample() row by row."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=g) * 4
    logits[2, 7] = logits[2, 100] = logits[2].max() + 1  # a tie: the first index wins
    ids, logprobs = greedy_batch(logits)
    for row in range(5):
        want_id, want_lp = sample(logits[row:row + 1], [SamplingParams(temperature=0.0)],
                                  [None])
        assert ids[row] == int(want_id[0])
        assert logprobs[row] == float(want_lp[0])
        assert logprobs[row] == pytest.approx(
            float(torch.log_softmax(logits[row], -1)[ids[row]]), abs=1e-5)
    assert ids[2] == 7


# temperature alone, then with each filter
FILTERS = [dict(temperature=0.7), dict(temperature=1.3, top_k=5),
           dict(temperature=0.5, top_p=0.9), dict(temperature=1.0, min_p=0.05)]


@pytest.mark.parametrize("vocab", [50, 49152])
def test_sample_batch_is_what_sample_returns_row_by_row(vocab):
    """Same draws from each row's generator, so the same tokens and logprobs, bit for bit,
    over several steps, with temperature alone and with each filter."""
    logits = _logits(rows=16, vocab=vocab, seed=1)
    params = [SamplingParams(seed=i, **FILTERS[i % 4]) for i in range(16)]
    one_by_one = [make_generator(i, 0, "cpu") for i in range(16)]
    batched = [make_generator(i, 0, "cpu") for i in range(16)]
    for _ in range(3):
        expected = [sample(logits[i:i + 1], [p], [g]) for i, (p, g) in
                    enumerate(zip(params, one_by_one, strict=True))]
        ids, logprobs = sample_batch(logits, params, batched)
        assert ids == [int(t[0]) for t, _ in expected]
        assert logprobs == [float(lp[0]) for _, lp in expected]


def test_batched_draws_with_grammar_masks_are_what_sample_returns_row_by_row():
    """Rows that follow a grammar go through the batched draws with their masks: the same
    tokens and raw logprobs as ``sample(..., allowed=...)`` row by row, each filter
    applied to the masked row, and never a token outside the mask."""
    logits = _logits(rows=8, vocab=300, seed=3)
    g = torch.Generator().manual_seed(4)
    allowed = torch.rand(8, 300, generator=g) < 0.1
    allowed[0] = True  # an unconstrained row in the same batch
    ids, logprobs = greedy_batch(logits, allowed)
    for row in range(8):
        want_id, want_lp = sample(logits[row:row + 1], [SamplingParams(temperature=0.0)],
                                  [None], allowed=[allowed[row]])
        assert (ids[row], logprobs[row]) == (int(want_id[0]), float(want_lp[0]))
        assert allowed[row, ids[row]]
    params = [SamplingParams(seed=i, **FILTERS[i % 4]) for i in range(8)]
    one_by_one = [make_generator(i, 0, "cpu") for i in range(8)]
    batched = [make_generator(i, 0, "cpu") for i in range(8)]
    for _ in range(3):
        expected = [sample(logits[i:i + 1], [p], [gen], allowed=[allowed[i]]) for i, (p, gen)
                    in enumerate(zip(params, one_by_one, strict=True))]
        ids, logprobs = sample_batch(logits, params, batched, allowed)
        assert ids == [int(t[0]) for t, _ in expected]
        assert logprobs == [float(lp[0]) for _, lp in expected]
        assert all(allowed[row, t] for row, t in enumerate(ids))


def test_inverse_cdf_never_picks_a_token_of_probability_zero():
    """At the ends of [0, 1) and around zero-probability tokens (first, middle, last):
    u = 0 takes the first possible token, the largest u below 1 the last possible one."""
    from kvscope.engine.sampling_ops import _inverse_cdf

    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0, 0.0]] * 4)
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    u = torch.stack([torch.tensor(0.0), torch.tensor(0.3), torch.tensor(0.74), below_one])
    assert _inverse_cdf(probs, u).tolist() == [1, 3, 3, 4]
    for total in (1.0, 3.0, 2.0 ** 20, 1e-30, 7.3e5):  # unnormalised rows too
        assert _inverse_cdf(probs * total, below_one[None].expand(4)).tolist() == [4] * 4



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_inverse_cdf_stays_within_the_row_whatever_the_probs_dtype(dtype):
    """A half-precision row's u of 0.999 rounds to 1.0 and a subnormal total absorbs
    u < 1: neither may search past the last token of nonzero probability."""
    from kvscope.engine.sampling_ops import _inverse_cdf

    probs = torch.tensor([[0.25, 0.75, 0.0, 0.0]], dtype=dtype)
    for u in (0.999, 0.9999, float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))):
        assert _inverse_cdf(probs, torch.tensor([u])).tolist() == [1]
    tiny = torch.tensor([[0.0, 2.0 ** -140, 0.0]])  # a subnormal float32 total
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    assert _inverse_cdf(tiny, below_one[None]).tolist() == [1]

def test_top_logprobs_batch_is_what_top_logprobs_returns_row_by_row():
    logits = _logits(rows=5, vocab=50, seed=2)
    ks = [0, 1, 5, 50, 3]
    params = [SamplingParams(temperature=0.0, logprobs=k) for k in ks]
    chosen = [7, 0, 49, 12, 3]  # any token, not only the argmax
    expected = [top_logprobs(logits[i:i + 1], [p], torch.tensor([t]))[0]
                for i, (p, t) in enumerate(zip(params, chosen, strict=True))]
    got = top_logprobs_batch(logits, ks, chosen)
    assert got == expected
    assert [list(e) for e in got] == [list(e) for e in expected]  # same order: chosen first
