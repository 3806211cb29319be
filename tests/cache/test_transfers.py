"""plan_rounds batches swap orders without changing their sequential meaning."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from kvscope.engine.cache.transfers import IN, OUT, plan_rounds


def run_sequential(orders, gpu, cpu):
    for d, a, b in orders:
        if d == OUT:
            cpu[b] = gpu[a]
        else:
            gpu[b] = cpu[a]


def run_rounds(rounds, gpu, cpu):
    for outs, ins in rounds:
        for pairs, src, dst in ((outs, gpu, cpu), (ins, cpu, gpu)):
            assert len({b for _, b in pairs}) == len(pairs), "a batch writes a block twice"
            vals = [src[a] for a, _ in pairs]  # gather, then scatter
            for (_, b), v in zip(pairs, vals, strict=True):
                dst[b] = v


orders_st = st.lists(st.tuples(st.sampled_from([OUT, IN]), st.integers(0, 5),
                               st.integers(0, 5)), max_size=30)


# deadline and the too_slow health check time the machine, not plan_rounds
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(orders=orders_st)
def test_rounds_equal_sequential_execution(orders):
    seq_gpu, seq_cpu = {i: ("g", i) for i in range(6)}, {i: ("c", i) for i in range(6)}
    rnd_gpu, rnd_cpu = dict(seq_gpu), dict(seq_cpu)
    run_sequential(orders, seq_gpu, seq_cpu)
    rounds = plan_rounds(orders)
    run_rounds(rounds, rnd_gpu, rnd_cpu)
    assert (rnd_gpu, rnd_cpu) == (seq_gpu, seq_cpu)
    assert sum(len(o) + len(i) for o, i in rounds) == len(orders)


def test_a_usual_step_is_one_round():
    # swap-outs and write-backs, then swap-ins and host hits into other blocks
    orders = [(OUT, 3, 0), (OUT, 4, 1), (IN, 5, 3), (IN, 6, 7), (OUT, 9, 2)]
    assert plan_rounds(orders) == [([(3, 0), (4, 1), (9, 2)], [(5, 3), (6, 7)])]


def test_host_block_read_by_an_in_then_reused_by_an_out_splits():
    orders = [(IN, 0, 5), (OUT, 6, 0)]  # host block 0 is read before it is overwritten
    assert plan_rounds(orders) == [([], [(0, 5)]), ([(6, 0)], [])]
    assert plan_rounds([]) == []


def test_unknown_direction():
    with pytest.raises(ValueError, match="direction"):
        plan_rounds([("sideways", 0, 1)])
