"""Does one heavy prompt pause everyone? A running stream's longest gap between chunks
while six 3 MB prompts arrive at once, this tree against another revision, side by side:
``python scripts/bench_admission_stall.py [REV] [--rounds R]`` (REV defaults to the commit
before admission moved off the event loop).

Both trees serve the default model (``kvscope serve``, default flags: a 4 MiB body limit,
so a 3 MB prompt is accepted as a body and refused as too long for the context). Per
round and tree, alternating: a quiet stream (its max and median gap between chunks),
then a stream during which six 3 MB prompts are sent at once (its max gap while they
are in flight). Goal (issue 36): the loaded max gap within 100 ms of the quiet max gap.
Needs a git checkout (REV is exported with ``git archive``), so it lives here."""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
BEFORE = "231707a^"  # "server: ... Admission ... runs off the event loop"
READY = re.compile(r"ready on (http://\S+)")
PROMPT_BYTES = 3_000_000
HEAVY = 6


def export_tree(rev: str, into: Path) -> Path:
    root = into / "tree"
    root.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "engine"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


def start(root: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.Popen([sys.executable, "-m", "kvscope.engine.cli", "serve", "--port", "0"],
                            cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # type: ignore[union-attr]
        m = READY.search(line)
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout],  # type: ignore
                             daemon=True).start()  # keep draining its log
            return proc, m.group(1)
    raise RuntimeError(f"the server from {root} did not start")


def stream_times(url: str, tokens: int, during: threading.Event | None = None
                 ) -> list[float]:
    """Arrival times of a streamed completion's chunks; sets ``during`` after 8."""
    body = {"prompt": "Write a long story about a lighthouse keeper.",
            "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    times: list[float] = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())
                if during is not None and len(times) == 8:
                    during.set()
    return times


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def heavy_prompt(seed: int) -> str:
    rng = random.Random(seed)
    words = ["lighthouse", "keeper", "storm", "the", "of", "a", "night", "ship", "light",
             "sea", "rock", "wave", "and", "in", "old", "lamp", "tower", "wind"]
    out, n = [], 0
    while n < PROMPT_BYTES:
        w = rng.choice(words)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def one_round(url: str, prompts: list[str], tokens: int) -> dict:
    quiet = gaps(stream_times(url, tokens)[1:])  # after the first chunk (the prefill)
    go = threading.Event()
    result: dict = {}

    def run_stream() -> None:
        result["times"] = stream_times(url, tokens, go)

    t = threading.Thread(target=run_stream)
    t.start()
    go.wait(300)
    burst: list[tuple[float, float, int]] = []
    # Encoded before the burst: six 3 MB json.dumps in this process would hold its GIL
    # and delay the stream reader's own clock, charging the client's work to the server.
    bodies = [json.dumps({"prompt": p, "max_tokens": 1}).encode() for p in prompts]

    def send(body: bytes) -> None:
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", content=body, timeout=300,
                       headers={"content-type": "application/json"})
        burst.append((t0, time.perf_counter(), r.status_code))

    senders = [threading.Thread(target=send, args=(b,)) for b in bodies]
    for s in senders:
        s.start()
    for s in senders:
        s.join()
    t.join()
    start_t = min(b[0] for b in burst)
    end_t = max(b[1] for b in burst)
    times = result["times"]
    # the gaps that overlap the burst (from the last chunk before it to the first after)
    window = [b - a for a, b in zip(times, times[1:], strict=False)
              if b >= start_t and a <= end_t]
    return {"quiet_max_ms": round(max(quiet) * 1e3, 1),
            "quiet_median_ms": round(statistics.median(quiet) * 1e3, 1),
            "loaded_max_ms": round(max(window, default=0.0) * 1e3, 1),
            "burst_s": round(end_t - start_t, 2),
            "statuses": sorted({b[2] for b in burst})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", nargs="?", default=BEFORE)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256,
                    help="each stream's length (it must outlast the burst)")
    args = ap.parse_args()
    prompts = [heavy_prompt(i) for i in range(HEAVY)]
    out: dict = {"load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as d:
        trees = {"this tree": REPO, args.rev: export_tree(args.rev, Path(d))}
        servers = {name: start(root) for name, root in trees.items()}
        print("servers up", file=sys.stderr, flush=True)
        try:
            rounds: dict[str, list[dict]] = {name: [] for name in trees}
            for _ in range(args.rounds):
                for name, (_, url) in servers.items():
                    rounds[name].append(one_round(url, prompts, args.tokens))
                    print(name, rounds[name][-1], file=sys.stderr, flush=True)
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait(30)
    for name, rs in rounds.items():
        out[name] = {"rounds": rs,
                     "quiet_max_ms_median": statistics.median(r["quiet_max_ms"] for r in rs),
                     "loaded_max_ms_median": statistics.median(r["loaded_max_ms"] for r in rs),
                     "growth_ms_median": statistics.median(
                         r["loaded_max_ms"] - r["quiet_max_ms"] for r in rs)}
    out["load_after"] = os.getloadavg()
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
