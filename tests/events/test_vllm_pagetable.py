"""The vLLM plugin's page-table differ (engine.events.vllm.pagetable), without vLLM: a small
model of vLLM's scheduler-side structures (BlockPool blocks with ref_cnt and hash keys,
single-type managers' req_to_blocks, request statuses, deferred frees) is driven by random
operations, several per step; after every step the state rebuilt from the differ's events
by ``KVState.apply`` equals the page table read from the model. The same property is
checked against the real vLLM in test_vllm_plugin.py.

The model notes the blocks each operation hands vLLM's BlockPool (what the plugin's
wrappers note), so every run drives two producers side by side: the full read every
step (the reference) and the incremental one (engine.events.vllm.tracker: only what a
step touched, checked by the full read every few steps); both must rebuild the full
read's state after every step, and the tracker's own table must equal it.

The model runs as vLLM 0.32 or 0.33 where the two differ in what the reader sees: 0.32
counts the null block's ref_cnt (touch and free_blocks count it, so it drifts), 0.33 keeps
it out of both and frees a sliding-window table without its leading null blocks
(pop_blocks_for_free trims them); with 0.33's lookahead block hashes a full block stays
unhashed for a step or more and is hashed later, while held."""

from __future__ import annotations

import random
from types import SimpleNamespace as NS

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvscope.engine.events import schema as S
from kvscope.engine.events.sink import ListSink
from kvscope.engine.events.state import KVState
from kvscope.engine.events.vllm.pagetable import (
    RESERVED,
    PageTableDiffer,
    canonical_of,
    hash_int,
    read_page_table,
)
from kvscope.engine.events.vllm.tracker import IncrementalReader, Touched

# vLLM's RequestStatus members, as distinct objects with a name
RUNNING, WAITING, PREEMPTED, STOPPED = (
    NS(name=n) for n in ("RUNNING", "WAITING", "PREEMPTED", "FINISHED_STOPPED"))


class Block:
    def __init__(self, i: int) -> None:
        self.block_id, self.ref_cnt, self._block_hash, self.is_null = i, 0, None, False


class Request:
    def __init__(self, rid: str, prompt: int) -> None:
        self.request_id, self.num_prompt_tokens, self.num_computed_tokens = rid, prompt, 0
        self.status = WAITING
        self.num_output_tokens = 0

    def is_finished(self) -> bool:
        return self.status is STOPPED


class FakeVllm:
    """Just enough of vLLM's v1 scheduler state, changed the way vLLM changes it."""

    def __init__(self, n: int, groups: int, rng: random.Random,
                 version: str = "0.33") -> None:
        self.rng = rng
        self.v032 = version == "0.32"
        self.late: list[Block] = []  # full blocks whose (lookahead) hash comes later
        self.blocks = [Block(i) for i in range(n)]
        self.blocks[0].is_null = True
        pool = NS(blocks=self.blocks, null_block=self.blocks[0])
        self.managers = [NS(req_to_blocks={}, kv_cache_spec=NS(block_size=16))
                         for _ in range(groups)]
        self.scheduler = NS(kv_cache_manager=NS(block_pool=pool, coordinator=NS(
            single_type_managers=self.managers)), requests={}, deferred_frees=[])
        self.cache: dict[bytes, Block] = {}
        self.next = 0
        self.touched = Touched()  # what the plugin's BlockPool wrappers would note

    # vLLM's BlockPool, in miniature
    def free_list(self) -> list[Block]:
        return [b for b in self.blocks[1:] if b.ref_cnt == 0]

    def take(self) -> Block | None:
        free = self.free_list()
        if not free:
            return None
        b = min(free, key=lambda b: b._block_hash is not None)  # uncached first
        if b._block_hash is not None:
            del self.cache[b._block_hash]
            b._block_hash = None
        b.ref_cnt = 1
        self.touched.ids.add(b.block_id)
        return b

    def release(self, blocks: list[Block]) -> None:
        for b in blocks:
            self.touched.ids.add(b.block_id)
            if not b.is_null or self.v032:  # 0.32 counts the null block down too
                b.ref_cnt -= 1

    def pop_for_free(self, table: dict[str, list[Block]], rid: str) -> list[Block]:
        blocks = table.pop(rid, [])
        if self.v032:
            return blocks
        i = next((i for i, b in enumerate(blocks) if not b.is_null), len(blocks))
        return blocks[i:]  # 0.33: without the leading null blocks

    def op(self) -> None:
        rng, sch = self.rng, self.scheduler
        live = [r for r in sch.requests.values() if not r.is_finished()]
        kind = rng.choice(["add", "add", "run", "run", "grow", "grow", "grow", "preempt",
                           "finish", "finish", "defer", "drain", "reset", "null", "late"])
        if kind == "add" or not live:
            rid = f"r{self.next}"
            self.next += 1
            sch.requests[rid] = Request(rid, rng.randint(1, 64))
            return
        r = rng.choice(live)
        tables = [m.req_to_blocks for m in self.managers]
        if kind == "run" and r.status is not RUNNING:
            if len(tables) > 1 and rng.random() < 0.3:  # a window hit's skipped prefix
                nulls = [self.blocks[0]] * rng.randint(1, 2)
                for b in nulls:
                    self.touched.ids.add(0)
                    if self.v032:  # touch counts the null block up (0.33 skips it)
                        b.ref_cnt += 1
                tables[-1].setdefault(r.request_id, []).extend(nulls)
            for t in tables:  # hits on a shared prefix, then fresh blocks
                for k in range(rng.randint(0, 3)):
                    key = b"p%d" % k + b"\0\0\0\0"
                    hit = self.cache.get(key)
                    if hit is None:
                        break
                    hit.ref_cnt += 1
                    self.touched.ids.add(hit.block_id)
                    t.setdefault(r.request_id, []).append(hit)
            r.status = RUNNING
        elif kind == "grow" and r.status is RUNNING:
            for t in tables:
                b = self.take()
                if b is None:
                    return
                t.setdefault(r.request_id, []).append(b)
                if not self.v032 and rng.random() < 0.2:  # full, its lookahead not yet
                    self.late.append(b)
                elif rng.random() < 0.6:  # full: it enters the prefix cache
                    key = (b"p%d" % rng.randint(0, 5) if rng.random() < 0.5
                           else rng.randbytes(8)) + b"\0\0\0\0"
                    if key not in self.cache:
                        b._block_hash = key
                        self.touched.ids.add(b.block_id)
                        self.cache[key] = b
            r.num_computed_tokens += rng.randint(1, 16)
        elif kind == "late" and self.late:  # the lookahead tokens exist: hashed now
            b = self.late.pop(rng.randrange(len(self.late)))
            key = rng.randbytes(8) + b"\0\0\0\0"
            if b.ref_cnt > 0 and b._block_hash is None:  # still held (else freed)
                b._block_hash = key
                self.touched.ids.add(b.block_id)
                self.cache[key] = b
        elif kind == "preempt" and r.status is RUNNING:
            for t in tables:
                self.release(self.pop_for_free(t, r.request_id))
            r.status, r.num_computed_tokens = PREEMPTED, 0
        elif kind == "finish":
            r.status = STOPPED
            r.num_output_tokens = 3
            for t in tables:
                self.release(self.pop_for_free(t, r.request_id))
            del sch.requests[r.request_id]
        elif kind == "defer" and r.status is RUNNING:  # freed after the step runs
            r.status = STOPPED
            for t in tables:
                sch.deferred_frees.append((0, self.pop_for_free(t, r.request_id)))
            del sch.requests[r.request_id]
        elif kind == "drain" and sch.deferred_frees:
            self.release(sch.deferred_frees.pop(0)[1])
        elif kind == "reset" and all(b.ref_cnt == 0 for b in self.blocks[1:]):
            for b in self.blocks:
                b._block_hash = None
            self.cache.clear()
            self.touched.all = True
        elif kind == "null" and r.status is RUNNING and len(self.managers) > 1:
            # a sliding-window group drops its oldest live block for the null block, in
            # place (the nulls are a growing prefix of the table, as in vLLM)
            t = tables[-1].get(r.request_id, [])
            i = next((i for i, b in enumerate(t) if not b.is_null), len(t))
            if i < len(t):
                self.release([t[i]])
                t[i] = self.blocks[0]


def run(seed: int, steps: int, n: int = 24, groups: int = 1,
        version: str = "0.33") -> tuple[KVState, dict]:
    rng = random.Random(seed)
    vllm = FakeVllm(n, groups, rng, version)
    reader = IncrementalReader(RUNNING, check_every=7)
    producers = [(PageTableDiffer(), ListSink(), KVState()) for _ in range(2)]
    counts: dict[str, int] = {}
    for step in range(steps):
        for _ in range(rng.randint(0, 6)):
            vllm.op()
        pt = read_page_table(vllm.scheduler, RUNNING)
        assert pt.unexplained == 0
        expected = canonical_of(pt)
        reset = vllm.touched.all
        incremental, dirty = reader.read(vllm.scheduler, vllm.touched)
        assert canonical_of(incremental) == expected, f"step {step}"
        assert (dirty is None) == (step == 0 or reset)  # else only what the step touched
        for k, (differ, sink, state) in enumerate(producers):
            if k == 0:
                differ.step(pt, sink)  # the reference: every block, every table
            else:
                differ.step(incremental, sink, dirty)
            events = sink.drain()
            if k == 0:
                for ev in events:
                    counts[ev["kind"]] = counts.get(ev["kind"], 0) + 1
            state.apply({"v": S.PROTOCOL_VERSION, "step": step, "events": events})
            assert state.canonical() == expected, f"step {step}, producer {k}"
            assert differ.canonical() == expected
            assert differ.unrepresentable == 0
            codes = state.block_codes("gpu").tolist()
            used = sum(c >= S.BLOCK_USED for c in codes)
            assert differ.block_counts() == {
                "total": n, "used": used, "cached": codes.count(S.BLOCK_CACHED),
                "free": codes.count(S.BLOCK_FREE)}
    assert reader.mismatches == 0 and reader.checks
    return state, counts


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), groups=st.sampled_from([1, 2]),
       version=st.sampled_from(["0.32", "0.33"]))
def test_rebuilt_state_equals_the_page_table_every_step(seed: int, groups: int,
                                                        version: str) -> None:
    run(seed, 60, groups=groups, version=version)


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_a_long_run_covers_every_kind_it_translates(version: str) -> None:
    counts: dict[str, int] = {}
    for seed in range(4):
        for k, v in run(seed, 300, groups=1 + seed % 2, version=version)[1].items():
            counts[k] = counts.get(k, 0) + v
    for kind in (S.TIER_INIT, S.SEQ_ADD, S.SEQ_START, S.SEQ_RESUME, S.ALLOC, S.HIT, S.STORE,
                 S.EVICT, S.FREE, S.SEQ_PREEMPT, S.SEQ_FINISH, S.SEQ_TOKENS):
        assert counts.get(kind), kind


def test_a_change_no_wrapper_noted_is_found_by_the_check_and_resynced(caplog) -> None:
    vllm = FakeVllm(8, 1, random.Random(0))
    r = Request("a", 10)
    vllm.scheduler.requests["a"] = r
    r.status = RUNNING
    vllm.managers[0].req_to_blocks["a"] = [vllm.take(), vllm.take()]
    reader = IncrementalReader(RUNNING, check_every=3)
    differ, sink, state = PageTableDiffer(), ListSink(), KVState()
    for step in range(4):
        if step == 1:  # a hash set behind the wrappers' back (a path they do not cover)
            vllm.blocks[1]._block_hash = b"x" * 8 + b"\0\0\0\0"
        pt, dirty = reader.read(vllm.scheduler, vllm.touched)
        differ.step(pt, sink, dirty)
        state.apply({"v": S.PROTOCOL_VERSION, "step": step, "events": sink.drain()})
        missed = step == 1  # until the check at the third read (step 2)
        assert (state.canonical() == canonical_of(read_page_table(vllm.scheduler, RUNNING))
                ) != missed, step
    assert reader.mismatches == 1 and reader.checks == 1
    assert "differed from vLLM's in 1 blocks/sequences" in caplog.text


def test_reserved_holds_the_null_block_and_deferred_frees() -> None:
    vllm = FakeVllm(8, 1, random.Random(0))
    r = Request("a", 10)
    vllm.scheduler.requests["a"] = r
    r.status = RUNNING
    blocks = [vllm.take(), vllm.take()]
    vllm.managers[0].req_to_blocks["a"] = blocks
    differ, sink = PageTableDiffer(), ListSink()
    differ.step(read_page_table(vllm.scheduler, RUNNING), sink)
    sink.drain()
    r.status = STOPPED  # finished; a connector still reads its blocks
    vllm.scheduler.deferred_frees.append((1, vllm.managers[0].req_to_blocks.pop("a")))
    del vllm.scheduler.requests["a"]
    pt = read_page_table(vllm.scheduler, RUNNING)
    assert sorted(pt.seqs[RESERVED].table) == [0, 1, 2] and "a" not in pt.seqs
    differ.step(pt, sink)
    kinds = [e["kind"] for e in sink.drain()]
    assert kinds[:2] == [S.FREE, S.SEQ_FINISH] and S.ALLOC in kinds


def test_refs_no_table_explains_go_to_reserved_and_are_counted() -> None:
    vllm = FakeVllm(8, 1, random.Random(0))
    b = vllm.take()  # held by something vLLM does not expose to the scheduler's tables
    pt = read_page_table(vllm.scheduler, RUNNING)
    assert pt.unexplained == 1 and pt.seqs[RESERVED].table == [0, b.block_id]


@pytest.mark.parametrize("raw, want", [
    (bytes(24) + b"\0\0\0\1", 0),
    (b"\xff" * 32 + b"\0\0\0\0", -1),
    (bytes(24) + (1 << 63).to_bytes(8, "big") + b"\0\0\0\0", -(1 << 63)),
    (bytes(24) + (5).to_bytes(8, "big") + b"\0\0\0\2", 5),
])
def test_hash_is_vllms_int_form_as_signed_int64(raw: bytes, want: int) -> None:
    assert hash_int(raw) == want


def test_a_held_block_losing_its_hash_is_counted_not_sent() -> None:
    vllm = FakeVllm(8, 1, random.Random(0))
    r = Request("a", 10)
    vllm.scheduler.requests["a"] = r
    r.status = RUNNING
    b = vllm.take()
    b._block_hash = b"h" * 8 + b"\0\0\0\0"
    vllm.managers[0].req_to_blocks["a"] = [b]
    differ, sink, state = PageTableDiffer(), ListSink(), KVState()
    differ.step(read_page_table(vllm.scheduler, RUNNING), sink)
    state.apply({"v": 2, "step": 0, "events": sink.drain()})
    b._block_hash = None  # vLLM's connector evict_blocks on a held block
    differ.step(read_page_table(vllm.scheduler, RUNNING), sink)
    state.apply({"v": 2, "step": 1, "events": sink.drain()})  # still a valid stream
    assert differ.unrepresentable == 1
    assert state.canonical() == differ.canonical()


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_the_null_block_reads_as_one_taken_block_whatever_vllm_counts(version) -> None:
    """0.32's null block ref_cnt drifts with the window tables that touch and free it;
    0.33's stays 0 (never counted): the reader shows 1 either way, held by RESERVED."""
    vllm = FakeVllm(8, 2, random.Random(0), version)
    r = Request("a", 10)
    vllm.scheduler.requests["a"] = r
    r.status = RUNNING
    null = vllm.blocks[0]
    if vllm.v032:
        null.ref_cnt = 5
    vllm.managers[1].req_to_blocks["a"] = [null, null, vllm.take()]
    vllm.managers[0].req_to_blocks["a"] = [vllm.take()]
    pt = read_page_table(vllm.scheduler, RUNNING)
    assert pt.ref[0] == 1 and pt.unexplained == 0
    assert pt.seqs["a/g1"].table == [1] and pt.seqs[RESERVED].table == [0]
    reader = IncrementalReader(RUNNING)
    reader.read(vllm.scheduler, vllm.touched)
    vllm.touched.ids.add(0)  # a step that touched (0.32: counted) the null block again
    null.ref_cnt += vllm.v032
    incremental, dirty = reader.read(vllm.scheduler, vllm.touched)
    assert dirty == {0} and incremental.ref[0] == 1
    assert canonical_of(incremental) == canonical_of(read_page_table(vllm.scheduler,
                                                                     RUNNING))


def test_a_full_block_hashed_steps_later_is_stored_then() -> None:
    """0.33's lookahead hashes: a full block is held unhashed for a step (an alloc, no
    store), then hashed while held (a store of the block then, no alloc or hit)."""
    vllm = FakeVllm(8, 1, random.Random(0), "0.33")
    r = Request("a", 32)
    vllm.scheduler.requests["a"] = r
    r.status = RUNNING
    b = vllm.take()
    vllm.managers[0].req_to_blocks["a"] = [b]
    reader = IncrementalReader(RUNNING)
    differ, sink, state = PageTableDiffer(), ListSink(), KVState()
    kinds = []
    for step in range(3):
        if step == 2:
            b._block_hash = b"L" * 8 + b"\0\0\0\0"
            vllm.touched.ids.add(b.block_id)
        pt, dirty = reader.read(vllm.scheduler, vllm.touched)
        differ.step(pt, sink, dirty)
        events = sink.drain()
        kinds.append([e["kind"] for e in events if e["kind"] in (S.ALLOC, S.STORE, S.HIT)
                      and e.get("seq") != RESERVED])
        state.apply({"v": S.PROTOCOL_VERSION, "step": step, "events": events})
        assert state.canonical() == canonical_of(read_page_table(vllm.scheduler, RUNNING))
    assert kinds == [[S.ALLOC], [], [S.STORE]]
    assert state.canonical()["tiers"]["gpu"]["hash"][b.block_id] == hash_int(b._block_hash)


@pytest.mark.parametrize("same_blocks", [False, True])
def test_a_request_preempted_and_readmitted_within_a_step_is_said(same_blocks) -> None:
    """vLLM's reset_prefix_cache(reset_running_requests=True) preempts every running
    request between two steps and the next schedule() re-admits them: running at both
    boundaries. The plugin's hook noted the preemption; the step says preempt, free,
    resume and the new table, even when the new table has the very same block ids."""
    vllm = FakeVllm(8, 1, random.Random(0))
    r = Request("a", 40)
    vllm.scheduler.requests["a"] = r
    r.status = RUNNING
    old = [vllm.take(), vllm.take()]
    vllm.managers[0].req_to_blocks["a"] = old
    r.num_computed_tokens = 32
    differ, sink, state = PageTableDiffer(), ListSink(), KVState()
    differ.step(read_page_table(vllm.scheduler, RUNNING), sink)
    state.apply({"v": S.PROTOCOL_VERSION, "step": 0, "events": sink.drain()})
    vllm.release(vllm.managers[0].req_to_blocks.pop("a"))  # preempted: freed
    differ.preempt_causes["a"] = {"reason": "reset"}
    if same_blocks:
        for b in old:
            b.ref_cnt = 1
        new = list(old)
    else:
        new = [vllm.take()]
    vllm.managers[0].req_to_blocks["a"] = new  # re-admitted by the next schedule()
    r.num_computed_tokens = 16
    differ.step(read_page_table(vllm.scheduler, RUNNING), sink)
    events = sink.drain()
    mine = [e for e in events if e.get("seq") == "a" or "a" in e.get("seqs", ())]
    assert [e["kind"] for e in mine] == [S.SEQ_PREEMPT, S.FREE, S.SEQ_RESUME, S.ALLOC,
                                         S.SEQ_TOKENS]
    assert mine[0]["cause"] == {"reason": "reset"} and not differ.preempt_causes
    state.apply({"v": S.PROTOCOL_VERSION, "step": 1, "events": events})
    assert state.canonical() == canonical_of(read_page_table(vllm.scheduler, RUNNING))
    assert state.seqs["a"].preemptions == 1
