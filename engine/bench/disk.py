"""`kvscope bench disk`: what the disk tier buys, side by side in one run.

1. TTFT of a request whose ``--prefix`` -token prefix (random ids, deterministic) was
   computed by an earlier request and is now: on the device; in the host tier; on disk
   only, with the page cache of its files dropped (``posix_fadvise(DONTNEED)`` after an
   fsync: reads come from the disk); after a restart (an engine that computed it stopped
   gracefully, a new one starts over its directory) kept (warm) or emptied (cold); absent
   (recomputed, no tiers). Each trial is a fresh engine over one loaded model; the modes
   alternate, ``--repeat`` rounds, best of each.
2. The tier's achieved read rate in the disk trial (bytes read / the wall time reads were
   in flight, and bytes / the request's TTFT) and, right after it, the disk's own
   sequential read rate over as many bytes (one file, page cache dropped, 4 MiB reads):
   side by side, under the same load (the best ratio of the rounds).
3. A restart: the first ``--restart-requests`` requests of the demo workload's sessions
   (shared system prompts and documents) after an engine that served earlier sessions
   stopped, with its directory kept vs emptied: prefix hit rate and TTFT p50.
4. Engine step time with the tier on and idle vs off (decode steps of one request),
   alternating A/B.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("disk", help="disk KV tier: TTFT by tier, read rate, restart, overhead")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefix", type=int, nargs="+", default=[2048, 8176],
                   help="prefix lengths in tokens (8176 + the question fits 8192)")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--restart-requests", type=int, default=8)
    p.add_argument("--dir", default=None, help="where the tier's files go (default: a "
                   "temporary directory on the disk under test)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def drop_page_cache(directory: Path) -> None:
    """Write back and drop the cached pages of every file under ``directory``."""
    for f in directory.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def sequential_read_rate(directory: Path, nbytes: int) -> float:
    """Bytes/s reading one ``nbytes`` file with a dropped page cache, 4 MiB at a time."""
    path = directory / "seqread.bin"
    chunk = os.urandom(4 << 20)
    with open(path, "wb") as f:
        for _ in range(max(1, nbytes // len(chunk))):
            f.write(chunk)
    size = path.stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        while os.read(fd, 4 << 20):
            pass
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
    return size / dt


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        from kvscope.engine.device import resolve_device, resolve_dtype
        from kvscope.engine.model import load_model
        from kvscope.engine.runner.page_format import page_format

        self.args, self.root = args, root
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype("auto", self.device)
        self.loaded = load_model(args.model, device=self.device, dtype=self.dtype)
        self.vocab = self.loaded[2].vocab_size
        self.per_block = page_format("auto", self.dtype, self.loaded[2],
                                     args.block_size).bytes_per_block
        self.n = 0

    def engine(self, blocks: int, tiers: bool, directory: Path | None = None, **kw):
        from kvscope.engine.config import EngineConfig
        from kvscope.engine.engine import LLMEngine

        a = self.args
        extra: dict[str, Any] = {}
        if tiers:
            self.n += 1
            extra = dict(swap_space=(blocks + 0.5) * self.per_block / (1 << 30),
                         disk_cache_dir=str(directory or self.root / f"kv{self.n}"),
                         disk_cache_size=4 * blocks * (self.per_block + 4096))
        cfg = EngineConfig(model=a.model, device=a.device, dtype=self.dtype,
                           block_size=a.block_size, num_gpu_blocks=blocks,
                           max_num_batched_tokens=2048, **extra, **kw)
        return LLMEngine(cfg, loaded=self.loaded)

    @staticmethod
    def finish(eng, rid: str, ids: list[int], max_tokens: int = 1) -> float:
        """Run one request alone to its end; seconds taken (with ``max_tokens`` 1: its
        time to first token)."""
        from kvscope.engine.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        eng.add_request(rid, {"prompt_token_ids": ids}, params)
        while eng.has_unfinished_requests():
            eng.step()
        return time.perf_counter() - t0

    # ----------------------------------------------------------------- 1, 2
    def ttft(self, prefix_tokens: int) -> dict[str, Any]:
        a = self.args
        rng = random.Random(prefix_tokens)
        prefix = [rng.randrange(3, self.vocab) for _ in range(prefix_tokens)]
        first = prefix + [rng.randrange(3, self.vocab) for _ in range(8)]
        second = prefix + [rng.randrange(3, self.vocab) for _ in range(8)]
        blocks = 2 * -(-(prefix_tokens + 16) // a.block_size) + 8
        best: dict[str, float] = {}
        rate: dict[str, float] = {}
        for _ in range(a.repeat):
            for mode in ("device", "host", "disk", "restart_warm", "restart_cold",
                         "recompute"):
                if mode.startswith("restart"):
                    best[mode] = min(best.get(mode, float("inf")),
                                     self.restarted(blocks, first, second,
                                                    warm=mode == "restart_warm"))
                    continue
                eng = self.engine(blocks, tiers=mode != "recompute")
                self.finish(eng, "first", first)
                if mode != "device":
                    eng.cache.evict_cached()
                if mode == "disk":
                    # the whole prefix goes to disk: saves wait for room in the writer's
                    # queue (as at a graceful stop) instead of being dropped
                    eng.disk_io.persist_until = time.monotonic() + 600
                    eng.cache.pools["cpu"].evict()
                if mode in ("host", "disk"):
                    eng.step()  # performs the copies, queues the writes
                if mode == "disk":
                    assert eng.disk_io.drain(time.monotonic() + 600) == 0
                    eng.disk_io.persist_until = None
                    assert eng.disk_io.stats.dropped == 0, "the prefix did not all reach disk"
                    drop_page_cache(Path(eng.config.disk_cache_dir))
                    st = eng.disk_io.stats
                    r0, s0 = st.bytes_read, st.read_busy_s
                dt = self.finish(eng, "second", second)
                m = eng.cache.metrics()
                if mode == "disk":
                    st = eng.disk_io.stats
                    got = st.bytes_read - r0
                    assert m["host_hit_tokens"] > 0, "the disk trial hit nothing"
                    tier = got / max(st.read_busy_s - s0, 1e-9) / 1e6
                    # the disk's own rate right after, over as many bytes (same load)
                    seq = sequential_read_rate(self.root, got) / 1e6
                    if tier / seq > rate.get("tier_vs_disk_rate", -1.0):
                        rate = {"tier_read_bytes": got, "tier_reader_rate_mb_s": tier,
                                "tier_wall_rate_mb_s": got / dt / 1e6,
                                "disk_seq_read_mb_s": seq, "tier_vs_disk_rate": tier / seq}
                best[mode] = min(best.get(mode, float("inf")), dt)
                eng.close()
        out = {f"ttft_{k}_s": v for k, v in best.items()}
        out.update(rate)
        out["disk_vs_recompute"] = best["disk"] / best["recompute"]
        out["restart_warm_vs_cold"] = best["restart_warm"] / best["restart_cold"]
        return out

    def restarted(self, blocks: int, first: list[int], second: list[int], warm: bool) -> float:
        """TTFT of ``second`` on a new engine started over the directory an engine that
        served ``first`` left at its graceful stop: kept (warm, page cache dropped) or
        emptied (cold)."""
        self.n += 1
        directory = self.root / f"restart{self.n}"
        eng = self.engine(blocks, tiers=True, directory=directory)
        self.finish(eng, "first", first)
        eng.close()  # the graceful stop writes the cached prefix to disk
        for f in directory.iterdir():
            if not warm and f.suffix == ".kv":
                f.unlink()
        drop_page_cache(directory)
        eng = self.engine(blocks, tiers=True, directory=directory)
        dt = self.finish(eng, "second", second)
        hit = eng.cache.metrics()["prefix_hit_tokens"]
        assert (hit > 0) == warm, f"restart ({'warm' if warm else 'cold'}) hit {hit} tokens"
        eng.close()
        return dt

    # -------------------------------------------------------------------- 3
    def restart(self) -> dict[str, Any]:
        from kvscope.engine.loadgen.workloads import load_workload, sessions

        a = self.args
        tok = self.loaded[1]
        w = load_workload("demo")

        def ids(s) -> list[int]:
            text = (s.system + "\n\n" if s.system else "") + s.turns[0]
            if tok is None:
                return [hash(t) % (self.vocab - 3) + 3 for t in text.split()]
            return tok.encode(text)[:8000]

        before = [ids(s) for s in sessions(w, seed=1, rate=10.0, duration=60.0,
                                           max_sessions=3 * a.restart_requests)]
        after = [ids(s) for s in sessions(w, seed=2, rate=10.0, duration=60.0,
                                          max_sessions=a.restart_requests)]
        blocks = 2 * -(-max(map(len, before + after)) // a.block_size) + 16
        directory = self.root / "restart"
        results: dict[str, Any] = {}
        for kept in (True, False):
            shutil.rmtree(directory, ignore_errors=True)
            eng = self.engine(blocks, tiers=True, directory=directory)
            for i, p in enumerate(before):
                self.finish(eng, f"b{i}", p)
            eng.close()  # the graceful stop writes the cache down
            if not kept:
                for f in directory.iterdir():
                    f.unlink()
            drop_page_cache(directory)
            eng = self.engine(blocks, tiers=True, directory=directory)
            times = [self.finish(eng, f"a{i}", p) for i, p in enumerate(after)]
            m = eng.cache.metrics()
            key = "kept" if kept else "emptied"
            results[f"restart_{key}_hit_rate"] = m["prefix_hit_rate"]
            results[f"restart_{key}_ttft_p50_s"] = statistics.median(times)
            eng.close()
        return results

    # -------------------------------------------------------------------- 4
    def overhead(self) -> dict[str, Any]:
        from kvscope.engine.sampling_params import SamplingParams

        rng = random.Random(7)
        prompt = [rng.randrange(3, self.vocab) for _ in range(64)]
        per: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(3):
            for mode in ("off", "on"):
                eng = self.engine(256, tiers=mode == "on")
                self.finish(eng, "warm", prompt, max_tokens=4)
                eng.add_request("r", {"prompt_token_ids": prompt},
                                SamplingParams(temperature=0.0, max_tokens=65, ignore_eos=True))
                eng.step()  # the prefill
                times = []
                while eng.has_unfinished_requests():
                    t0 = time.perf_counter()
                    eng.step()
                    times.append(time.perf_counter() - t0)
                per[mode].append(statistics.median(times))
                eng.close()
        on, off = min(per["on"]), min(per["off"])
        return {"step_ms_tier_off": off * 1e3, "step_ms_tier_on_idle": on * 1e3,
                "step_overhead": on / off - 1}


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    base = Path(args.dir) if args.dir else None
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="kvscope-disk-bench-", dir=base))
    try:
        b = Bench(args, root)
        out: dict[str, Any] = {"model": args.model, "block_size": args.block_size,
                               "bytes_per_block": b.per_block,
                               "load_avg_start": os.getloadavg()[0]}
        for p in args.prefix:
            out[f"prefix_{p}"] = b.ttft(p)
        got = out[f"prefix_{max(args.prefix)}"]
        out["disk_seq_read_mb_s"] = got["disk_seq_read_mb_s"]
        out["tier_vs_disk_rate"] = got["tier_vs_disk_rate"]
        out.update(b.restart())
        out.update(b.overhead())
        out["load_avg_end"] = os.getloadavg()[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
        return 0
    for k, v in out.items():
        if isinstance(v, dict):
            print(f"{k}:")
            for kk, vv in v.items():
                print(f"  {kk:>26}: {vv:.4g}" if isinstance(vv, float) else f"  {kk:>26}: {vv}")
        else:
            print(f"{k:>28}: {v:.4g}" if isinstance(v, float) else f"{k:>28}: {v}")
    return 0
