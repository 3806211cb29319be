"""The lifecycle index, causes, costs, range/compare and the Perfetto export, checked on
recordings of the real engine: every request's first-token step, finish step and
preemption count equal the engine's own; every preemption and eviction carries a cause;
the recompute share equals the engine's counters; a two-moment diff equals the
difference of state_at; the trace-event JSON is well-formed and matches the index."""

from __future__ import annotations

import itertools
import json
import time
import types

import numpy as np
import pytest

from kvscope.engine.commands import export as export_cmd
from kvscope.engine.events import causes as C
from kvscope.engine.events.analysis.export import COUNTER_TRACKS, REQUESTS_PID, trace_events
from kvscope.engine.events.analysis.lifecycle import PHASES, LifecycleIndex
from kvscope.engine.events.analysis.ranges import diff_states, range_summary
from kvscope.engine.events.wire.recording import Recording
from kvscope.engine.sampling_params import SamplingParams
from tests.engine.test_events_fidelity import workload
from tests.swap.test_swap_engine import swap_gib

# path of a recording -> the ServerMetrics that watched its run (on_step after each step)
SERVER_METRICS: dict = {}


def run_recorded(eng, on_step=None) -> dict:  # noqa: ANN001
    """Step until idle; per request the engine's own step of its first token and of its
    finish, and its final metrics."""
    seen: dict[str, dict] = {}
    while eng.has_unfinished_requests():
        outs = eng.step()
        if on_step is not None:
            on_step(eng)
        for out in outs:
            r = seen.setdefault(out.request_id, {"first": None, "finish": None})
            if r["first"] is None and out.metrics.first_token_time is not None:
                r["first"] = eng.step_count
            if out.finished:
                r["finish"], r["metrics"] = eng.step_count, out.metrics
    eng.close()
    return seen


class TickingClock:
    """One clock that moves 1 ms per reading: the engine's timings and the recording's
    stamps then depend on the order of the readings, never on how fast the box runs."""

    TICK_S = 0.001

    def __init__(self) -> None:
        self._ticks = itertools.count()
        self._origin = time.time()

    def read(self) -> float:
        return self._origin + next(self._ticks) * self.TICK_S

    def as_time_module(self, *names: str) -> types.SimpleNamespace:
        """A stand-in for a module's ``time`` whose ``names`` read this clock (the rest,
        e.g. sleep, stay the real ones)."""
        real = {n: getattr(time, n) for n in ("time", "monotonic", "perf_counter", "sleep")}
        return types.SimpleNamespace(**{**real, **{n: self.read for n in names}})


@pytest.fixture(scope="module")
def recorded(loaded, tmp_path_factory):
    """One recompute-mode run (prefix sharing, an n=2 fork, preemptions, evictions), its
    engine and recording on a ticking clock."""
    import kvscope.engine.engine
    import kvscope.engine.events.wire.stream
    import kvscope.engine.scheduler
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.engine import LLMEngine
    from kvscope.engine.server.metrics import ServerMetrics

    path = tmp_path_factory.mktemp("lifecycle") / "run.kvtrace"
    with pytest.MonkeyPatch.context() as mp:
        clock = TickingClock()
        # arrival, TTFT and step times
        for module in (kvscope.engine.engine, kvscope.engine.scheduler):
            mp.setattr(module, "time", clock.as_time_module("monotonic", "perf_counter"))
        # the recording's batch stamps, on the same clock
        mp.setattr(kvscope.engine.events.wire.stream, "time", clock.as_time_module("time"))
        eng = LLMEngine(EngineConfig(block_size=4, num_gpu_blocks=14, watermark=0.0,
                                     record_path=str(path)), loaded=loaded)
        workload(eng)
        SERVER_METRICS[path] = metrics = ServerMetrics("smollm2")
        seen = run_recorded(eng, metrics.on_step)
    assert eng.scheduler.num_preemptions > 0 and eng.cache.metrics()["evictions"] > 0
    return path, seen, eng


def test_index_matches_engine_timings(recorded):
    path, seen, _ = recorded
    check_timings(path, seen)


def check_timings(path, seen: dict) -> None:
    """Every request's first-token step, finish step, preemptions, output tokens and TTFT
    from the index equal the engine's own."""
    with Recording(path) as rec:
        idx = LifecycleIndex.for_recording(rec)
        assert LifecycleIndex.for_recording(rec) is idx  # computed once
        times = dict(zip(idx.steps["step"].tolist(), idx.steps["step_time"].tolist(),
                         strict=True))
    assert set(seen) == {s.request_id for s in idx.seqs.values()}
    for rid, want in seen.items():
        lives = [s for s in idx.seqs.values() if s.request_id == rid]
        m = want["metrics"]
        assert min(s.first_token_step for s in lives) == want["first"], rid
        assert max(s.finish_step for s in lives) == want["finish"], rid
        assert sum(len(s.preemptions) for s in lives) == m.num_preemptions, rid
        assert sum(s.output_tokens for s in lives) == m.num_generation_tokens, rid
        # TTFT in seconds (on the ticking clock): the index's arrival is the start of the
        # step after the add, its first token that step's end; the engine's lie inside
        # those bounds. A few readings (the workload's other adds) lie between an add and
        # the next step's start; half a tick absorbs the float rounding of the stamps.
        tick = TickingClock.TICK_S
        ttft = min(s.first_token_time for s in lives) - min(s.add_time for s in lives)
        assert -10 * tick <= ttft - m.time_to_first_token <= times[want["first"]] + tick / 2, rid
        if len(lives) == 1 and m.time_per_output_token is not None:
            # first token to finish: both end inside their steps, the index at the end
            span = lives[0].tpot * (m.num_generation_tokens - 1)
            engine_span = m.time_per_output_token * (m.num_generation_tokens - 1)
            slack = max(times[want["first"]], times[want["finish"]]) + tick / 2
            assert abs(span - engine_span) <= slack, rid
        for s in lives:
            kinds = [p.kind for p in s.phases]
            assert set(kinds) <= set(PHASES) and s.phase is None
            assert all(p.end_step is not None and p.end_step > p.start_step
                       for p in s.phases), (s.seq_id, s.phases)
            assert kinds.count("preempted") + kinds.count("swapped") == len(s.preemptions)


def test_every_preemption_and_eviction_has_a_cause(recorded, loaded, tmp_path):
    path, _, _ = recorded
    paths = [path]
    # and a swap-mode run with a small host pool: swap-outs, fallbacks, host evictions
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.engine import LLMEngine

    swap_path = tmp_path / "swap.kvtrace"
    eng = LLMEngine(EngineConfig(block_size=4, num_gpu_blocks=12, watermark=0.0,
                                 preemption_mode="swap", swap_space=swap_gib(6, 4, loaded),
                                 record_path=str(swap_path)), loaded=loaded)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    for i, q in enumerate(["Why is the sky blue?", "What is rain?", "Name a fruit.",
                           "What is snow?"]):
        eng.add_request(f"q{i}", "You are a helpful assistant. " * 2 + q, greedy)
    seen = run_recorded(eng)
    assert eng.cache.host.num_swap_outs > 0
    check_timings(swap_path, seen)  # the lifecycle of swapped sequences too
    paths.append(swap_path)
    counts = {"seq_preempt": 0, "evict": 0, "swap": 0}
    for p in paths:
        for batch in Recording(p):
            for ev in batch["events"]:
                if ev["kind"] not in ("seq_preempt", "evict"):
                    continue
                counts[ev["kind"]] += 1
                counts["swap"] += ev.get("mode") == "swap"
                cause = ev.get("cause")
                assert isinstance(cause, dict), ev
                assert cause[C.POLICY] and cause[C.REASON] in C.REASONS, ev
                if cause[C.REASON] != C.R_RESET:
                    assert isinstance(cause[C.NEEDED_BY], str), ev
                    assert cause[C.BLOCKS_NEEDED] > cause[C.FREE_BLOCKS] >= 0, ev
                assert "not recorded" not in C.describe(cause, ev["kind"])
    assert counts["seq_preempt"] and counts["evict"] and counts["swap"]


def test_recompute_share_equals_engine_counters(recorded):
    path, _, eng = recorded
    with Recording(path) as rec:
        idx = LifecycleIndex.for_recording(rec)
    assert eng.num_recomputed_tokens > 0
    assert idx.totals["recomputed_tokens"] == eng.num_recomputed_tokens
    assert idx.totals["prefill_tokens"] == eng.num_prefill_computed_tokens
    assert idx.recompute_share == eng.num_recomputed_tokens / eng.num_prefill_computed_tokens
    per_seq = sum(s.recomputed_tokens for s in idx.seqs.values())
    assert per_seq == eng.num_recomputed_tokens
    assert idx.decode_time_by_context()  # decode steps were binned by context length
    assert any(n.tokens_saved > 0 for n in idx.prefix_nodes())


def test_range_summary_and_diff_equal_state_at(recorded):
    path, seen, eng = recorded
    with Recording(path) as rec:
        idx = LifecycleIndex.for_recording(rec)
        steps = rec.steps
        whole = range_summary(idx, steps[0], steps[-1])
        assert whole["requests_finished"] == len(idx.seqs)
        assert whole["preemptions"] == eng.scheduler.num_preemptions
        assert whole["evicted_blocks"] == eng.cache.metrics()["evictions"]
        assert whole["peak_gpu_blocks"] <= eng.cache.gpu.num_blocks
        a, b = steps[len(steps) // 3], steps[2 * len(steps) // 3]
        sa, sb = rec.state_at(a), rec.state_at(b)
        d = diff_states(sa, sb)
        ref_a = np.asarray(sa.canonical()["tiers"]["gpu"]["ref"])
        ref_b = np.asarray(sb.canonical()["tiers"]["gpu"]["ref"])
        g = d["tiers"]["gpu"]
        assert g["allocated"] == np.flatnonzero((ref_a == 0) & (ref_b > 0)).tolist()
        assert g["freed"] == np.flatnonzero((ref_a > 0) & (ref_b == 0)).tolist()
        hash_a = sa.canonical()["tiers"]["gpu"]["hash"]
        hash_b = sb.canonical()["tiers"]["gpu"]["hash"]
        assert g["uncached"] == [i for i, (x, y) in enumerate(zip(hash_a, hash_b, strict=True))
                                 if x is not None and x != y]
        assert set(d["seqs_came"]) == set(sb.seqs) - set(sa.seqs)
        assert set(d["seqs_went"]) == set(sa.seqs) - set(sb.seqs)
        # the events between the moments say the same about who came and went
        added = {sid for sid, s in idx.seqs.items() if a < s.add_step <= b}
        gone = {sid for sid, s in idx.seqs.items()
                if s.finish_step is not None and a < s.finish_step <= b}
        assert set(d["seqs_came"]) == added - gone
        assert set(d["seqs_went"]) == gone - added
        # applying the diff to the first moment's block codes gives the second's
        codes = sa.block_codes("gpu").copy()
        codes[g["changed"]] = g["after"]
        assert (codes == sb.block_codes("gpu")).all()


def test_perfetto_export_is_valid_trace_json(recorded, tmp_path):
    path, _, _ = recorded
    out = tmp_path / "run.json"
    assert export_cmd.run(_args(path, "perfetto", out)) == 0
    doc = json.loads(out.read_text())
    events = doc["traceEvents"]
    need = {"X": {"name", "ts", "dur", "pid", "tid"}, "C": {"name", "ts", "pid", "args"},
            "i": {"name", "ts", "pid", "tid", "s"}, "M": {"name", "pid", "args"},
            "s": {"name", "ts", "pid", "tid", "id"}, "f": {"name", "ts", "pid", "tid", "id"}}
    for ev in events:
        assert ev["ph"] in need, ev
        assert need[ev["ph"]] <= set(ev), ev
        if ev["ph"] in ("X", "C", "i", "s", "f"):
            assert isinstance(ev["ts"], (int, float)) and ev["ts"] > 0
        if ev["ph"] == "X":
            assert ev["dur"] >= 0
        if ev["ph"] == "C":
            assert all(isinstance(v, (int, float)) for v in ev["args"].values())
    with Recording(path) as rec:
        idx = LifecycleIndex.for_recording(rec)
    names = {ev["tid"]: ev["args"]["name"] for ev in events
             if ev["ph"] == "M" and ev["name"] == "thread_name"}
    assert sorted(names.values()) == sorted(idx.seqs)  # one track per sequence
    for tid, sid in names.items():
        slices = [ev for ev in events if ev["ph"] == "X" and ev["tid"] == tid
                  and ev["pid"] == REQUESTS_PID]
        assert [ev["name"] for ev in slices] == [p.kind for p in idx.seqs[sid].phases]
        marks = [ev for ev in events if ev["ph"] == "i" and ev["tid"] == tid]
        assert len(marks) == len(idx.seqs[sid].preemptions)
        assert all(ev["args"]["needed_by"] for ev in marks)
    # flows pair up: one start and one end per id, the end on the victim's track
    starts = {ev["id"]: ev for ev in events if ev["ph"] == "s"}
    ends = {ev["id"]: ev for ev in events if ev["ph"] == "f"}
    assert starts.keys() == ends.keys() and starts
    others = sum(1 for s in idx.seqs.values() for p in s.preemptions
                 if p.cause and p.cause["needed_by"] != s.seq_id)
    assert len(starts) == others
    counters = {ev["name"] for ev in events if ev["ph"] == "C"}
    assert counters == set(COUNTER_TRACKS)
    assert len(trace_events(idx)) == len(events)
    # and the CSV tables
    d = tmp_path / "csv"
    assert export_cmd.run(_args(path, "csv", d)) == 0
    assert len((d / "requests.csv").read_text().splitlines()) == len(idx.seqs) + 1
    assert len((d / "steps.csv").read_text().splitlines()) == len(idx.steps["step"]) + 1


def test_export_rejects_a_bad_file(tmp_path, capsys):
    bad = tmp_path / "bad.kvtrace"
    bad.write_bytes(b"not a recording")
    assert export_cmd.run(_args(bad, "perfetto", tmp_path / "x.json")) == 2
    assert "not a kvscope recording" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def _args(path, fmt, out):
    import argparse

    return argparse.Namespace(recording=str(path), format=fmt, output=str(out))


def test_metrics_expose_the_costs(recorded):
    from kvscope.engine.loadgen.summary import parse_metrics
    from kvscope.engine.server.metrics import ServerMetrics

    _, _, eng = recorded
    m = ServerMetrics("smollm2")
    m.on_step(eng)
    got = parse_metrics(m.render().decode())
    assert got["kvscope:recomputed_prefill_tokens_total"] == eng.num_recomputed_tokens > 0
    assert got["kvscope:prefill_computed_tokens_total"] == eng.num_prefill_computed_tokens
    assert 0.0 <= got["kvscope:kv_cache_fragmentation_perc"] < 1.0


def test_decode_time_by_context_equals_events(recorded):
    """/metrics' latency-creep histogram (the engine's decoded contexts and step times)
    equals the lifecycle index's decode bins (the recording's events), per context range;
    the load summary reads the same figures; the timelines' cost series agree."""
    from kvscope.engine.events.analysis.costs import cost_series
    from kvscope.engine.loadgen.summary import DECODE_BY_CONTEXT, decode_by_context, parse_metrics
    from kvscope.engine.server.metrics import context_range

    path, _, eng = recorded
    got = parse_metrics(SERVER_METRICS[path].render().decode())
    with Recording(path) as rec:
        idx = LifecycleIndex.for_recording(rec)
    want: dict[str, list] = {}
    for lo, _hi, mean, n in idx.decode_time_by_context():
        acc = want.setdefault(context_range(lo), [0.0, 0])  # 64-token bins nest in ranges
        acc[0] += mean * n
        acc[1] += n
    head = DECODE_BY_CONTEXT + "_count|"
    have = {k[len(head):]: int(v) for k, v in got.items() if k.startswith(head)}
    assert have == {r: n for r, (_, n) in want.items()} and sum(have.values()) > 0
    assert sum(have.values()) == int(idx.steps["decode_tokens"].sum())
    rows = decode_by_context({}, got)
    assert [r["context_tokens"] for r in rows] == sorted(
        want, key=lambda r: int(r.split("-")[0].rstrip("+")))
    for r in rows:
        total, n = want[r["context_tokens"]]
        assert r["tokens"] == n
        assert r["tpot_ms"] == pytest.approx(total / n * 1e3, rel=1e-6)

    c = cost_series(idx)
    assert len(c["step"]) == len(idx.steps["step"])
    assert c["recompute_share"][-1] == pytest.approx(
        eng.num_recomputed_tokens / eng.num_prefill_computed_tokens)
    decoded = idx.steps["decode_tokens"] > 0
    assert np.array_equal(np.isfinite(c["decode_ms"]), decoded)
    assert np.all(c["decode_context"][decoded] >= 1)
    frag = c["fragmentation"][np.isfinite(c["fragmentation"])]
    assert frag.size and np.all((frag >= 0) & (frag < 1))
