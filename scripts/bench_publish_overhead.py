"""Publishing overhead on a real engine step: the same seeded workload on two LLMEngines
sharing one loaded model, one with events off, one publishing on loopback AND recording,
stepped alternately so both see the same machine load. Prints median step times and the
overhead; `scripts/bench_events.py` measures the stream itself.

    .venv/bin/python scripts/bench_publish_overhead.py [--requests 24] [--threads 1]
        [--model dummy:llama-3-8b --device cuda]
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvscope.engine.config import EngineConfig
from kvscope.engine.engine import LLMEngine
from kvscope.engine.model import load_model
from kvscope.engine.sampling_params import SamplingParams


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WARMUP_PAIRS = 2  # first step pairs left out: each engine's first prefill and captures


def time_alternating(engines: dict[str, Any], until: float | None = None,
                     clock: Callable[[], float] = time.perf_counter,
                     settle: Callable[[str, Any], None] | None = None) -> list[dict[str, float]]:
    """Step the engines in pairs until all are done (or ``until``, after a whole pair); the
    order inside a pair alternates (off-on, on-off, ...) so neither engine always pays for
    what the process does once (a Triton kernel's first compile, a lazy import) or always
    runs on a cache the other warmed. Returns one dict of step seconds per pair in which
    every engine stepped; ``settle(name, engine)`` runs inside the timed region after a
    step (the events-on engine's stream thread finishing that step's batch)."""
    names = list(engines)
    pairs: list[dict[str, float]] = []
    while any(e.has_unfinished_requests() for e in engines.values()):
        if until is not None and clock() >= until:
            break
        order = names if len(pairs) % 2 == 0 else names[::-1]
        pair: dict[str, float] = {}
        for name in order:
            eng = engines[name]
            if eng.has_unfinished_requests():
                t = clock()
                eng.step()  # returns after the sampled ids reached the host
                if settle is not None:
                    settle(name, eng)
                pair[name] = clock() - t
        if len(pair) == len(names):
            pairs.append(pair)
    return pairs


def overhead_of(pairs: list[dict[str, float]], warmup: int = WARMUP_PAIRS) -> dict[str, float]:
    """The on engine's cost over the off one: the median over step pairs of the relative
    difference (robust to a one-off compile or capture landing in one engine's step), beside
    the ratio of the totals. The first ``warmup`` pairs are left out when enough remain."""
    timed = pairs[warmup:] if len(pairs) > 2 * warmup else pairs
    off = [p["off"] for p in timed]
    on = [p["on"] for p in timed]
    rel = [(b - a) / a for a, b in zip(off, on, strict=True) if a > 0]
    return {
        "pairs": len(timed), "warmup_pairs": len(pairs) - len(timed),
        "step_ms_off": round(statistics.median(off) * 1e3, 3),
        "step_ms_on": round(statistics.median(on) * 1e3, 3),
        "overhead_pct": round(100 * statistics.median(rel), 2),
        "overhead_total_pct": round(100 * (sum(on) - sum(off)) / sum(off), 2),
    }


def measure_overhead(loaded, requests: int, max_tokens: int, device: str = "cpu",
                     dtype: str | torch.dtype = "auto", vocab_low: int = 100,
                     num_blocks: int = 512, until: float | None = None) -> dict:
    """Step an events-off and an events-on engine (sharing ``loaded``) alternately over the
    same seeded requests (``time_alternating``); median step times, the overhead
    (``overhead_of``) and the events/s at the on-engine's step rate. Also what
    scripts/gpu_check.py runs on the device. With ``until`` (a time.perf_counter() value)
    the alternation stops there, after a pair of steps, so both engines have run the same
    steps."""
    vocab = loaded[2].vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab_low, min(40000, vocab - 1))
                for _ in range(rng.randint(20, 200))] for _ in range(requests)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        common = {"block_size": 16, "num_gpu_blocks": num_blocks, "watermark": 0.0,
                  "device": device, "dtype": dtype}
        engines = {
            "off": LLMEngine(EngineConfig(**common), loaded=loaded),
            "on": LLMEngine(EngineConfig(**common,
                                         events_endpoint=f"tcp://127.0.0.1:{free_port()}",
                                         record_path=str(Path(tmp) / "run.kvtrace")),
                            loaded=loaded),
        }
        for eng in engines.values():
            for i, ids in enumerate(prompts):
                eng.add_request(f"r{i}", {"prompt_token_ids": ids}, params)

        def settle(name: str, eng: LLMEngine) -> None:
            if name == "on":  # charge the stream thread's work to the step
                eng.events.wait_idle(30)

        pairs = time_alternating(engines, until, settle=settle)
        on = engines["on"]
        on.events.wait_idle(30)
        events = sum(on.events.kind_counts.values())
        for eng in engines.values():
            eng.close()
    return {
        "steps": len(pairs), "events": events, "requests": requests, **overhead_of(pairs),
        "events_per_s_at_step_rate": round(events / sum(p["on"] for p in pairs), 1),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", default="smollm2", help="e.g. dummy:llama-3-8b on a GPU")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from kvscope.engine.device import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype("auto", device)
    loaded = load_model(args.model, device=device, dtype=dtype)
    result = measure_overhead(loaded, args.requests, args.max_tokens, str(device), dtype)
    print(json.dumps({"threads": args.threads, "model": args.model, "device": str(device),
                      **result}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
