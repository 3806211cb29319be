"""`kvscope serve`: the headless daemon with an OpenAI-compatible HTTP API.

    kvscope serve [MODEL | --model smollm2] [--host 127.0.0.1] [--port 8000]
                  [--events tcp://127.0.0.1:5557 [--events-keys DIR]] [--record run.kvtrace]
                  [engine flags]
                  [--kv-events-config '{"enable_kv_cache_events": true, ...}']  (vLLM's)
                  [--metrics-prefix kvscope|vllm]

Engine flags use vLLM's names. Binds loopback unless told otherwise; ``--api-key`` (or
env ``KVSCOPE_API_KEY``) makes /v1/* require ``Authorization: Bearer <key>``. The events
socket binds a non-loopback address only with CURVE keys (``--events-keys DIR``, made by
``kvscope keys DIR``).
"""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from kvscope.engine.events import formats
from kvscope.engine.server.tool_parsers import PARSERS as TOOL_PARSERS  # json only: no server stack


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the engine as an OpenAI-compatible HTTP daemon")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, given as vLLM's `vllm serve MODEL` takes it (same as "
                        "--model)")
    p.add_argument("--model", default=None,
                   help="'smollm2' (the default), a .gguf file, an HF dir or dummy:<preset> "
                        "(random weights: dummy:smollm2-135m, dummy:llama-3-8b; token-id "
                        "prompts only)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: --model)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default loopback; 0.0.0.0 exposes the API)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: pick a free one)")
    p.add_argument("--api-key", default=os.environ.get("KVSCOPE_API_KEY") or None,
                   help="require this bearer token on /v1/* (default: env KVSCOPE_API_KEY)")
    p.add_argument("--events", metavar="ENDPOINT", default=None,
                   help="publish cache events on this ZeroMQ endpoint, e.g. "
                        "tcp://127.0.0.1:5557 (snapshot/replay on port + 1)")
    p.add_argument("--events-keys", metavar="DIR",
                   default=os.environ.get("KVSCOPE_EVENTS_KEYS") or None,
                   help="CURVE keys for --events (made by `kvscope keys DIR`): only clients "
                        "whose keys are in DIR/allowed_clients attach, encrypted; needed to "
                        "bind anything but loopback (default: env KVSCOPE_EVENTS_KEYS)")
    p.add_argument("--record", metavar="PATH", default=None,
                   help="record the cache events to this .kvtrace file")
    p.add_argument("--kv-events-config", metavar="JSON", default=None,
                   help="also publish vLLM-format KV events (vLLM's flag and JSON keys), e.g. "
                        '\'{"enable_kv_cache_events": true, "publisher": "zmq", '
                        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'')
    p.add_argument("--metrics-prefix", choices=["kvscope", "vllm"], default="kvscope",
                   help="/metrics names: kvscope's (default) or vLLM's exact names and labels "
                        "for metrics vLLM also has (kvscope-only ones stay kvscope:)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGINT/SIGTERM, let in-flight requests finish for S seconds")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument("--max-n", type=int, default=16,
                   help="most completions per request (n x prompts)")
    p.add_argument("--max-logprobs", type=int, default=20,
                   help="most logprobs / top_logprobs / prompt_logprobs a request may ask "
                        "for (vLLM's name and default); more is a 400")
    p.add_argument("--chat-template", default=None, metavar="PATH_OR_TEMPLATE",
                   help="the Jinja chat template to use instead of the model's (a file, or "
                        "the template itself; vLLM's flag): for a model without one, or a "
                        "template that shows the model its tools")
    p.add_argument("--enable-auto-tool-choice", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="let tool_choice 'auto' through (OpenAI's default once tools are "
                        "given): the model decides whether to call, and --tool-call-parser "
                        "reads its calls (vLLM's flags)")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model family's tool-call syntax: hermes (Qwen2/2.5, Hermes: "
                        "<tool_call>{...}</tool_call>) or llama3_json (Llama 3.1+: "
                        '{"name": ..., "parameters": ...})')
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"])
    d = p.add_argument_group("data parallel (kvscope route in front of N replicas)")
    d.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                   help="start N replicas on loopback and a prefix-aware router on --port")
    d.add_argument("--routing-policy", default="prefix",
                   choices=("prefix", "least-load", "round-robin"))
    d.add_argument("--load-cost-tokens", type=int, default=32, metavar="T",
                   help="prefix policy: each queued/running request counts as T tokens")
    e = p.add_argument_group("engine (vLLM's names)")
    e.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="dummy: random weights of --model's shapes (a preset such as "
                        "llama-3-8b, or an HF dir's config.json); same as --model dummy:NAME")
    e.add_argument("--device", default="auto")
    e.add_argument("--dtype", default="auto")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-gpu-blocks", "--num-gpu-blocks-override", dest="num_gpu_blocks",
                   type=int, default=None, help="KV blocks (default: from memory)")
    e.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--kv-cache-dtype", default="auto", choices=formats.KV_CACHE_DTYPES,
                   help=" | ".join(formats.KV_CACHE_DTYPES))
    e.add_argument("--kv-demotion", default="",
                   help="demote cold pages in place under memory pressure: one or two of "
                        "int8, k8v4, int4, kivi4, kivi2 to fewer bits, e.g. int8,int4 or "
                        "int8,kivi4 (default off; needs --kv-cache-dtype auto)")
    e.add_argument("--kv-hot-window", type=int, default=256,
                   help="tokens at the end of each running sequence never demoted")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True)
    e.add_argument("--disable-hybrid-kv-cache-manager", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="a windowed model keeps every block of every layer (default: without "
                        "a swap tier or demotion, its sliding-window layers free the "
                        "blocks that left the window)")
    e.add_argument("--eviction-policy", default="lru", help="lru | lfu | priority")
    e.add_argument("--swap-space", type=float, default=0.0, help="GiB of CPU swap tier")
    e.add_argument("--disk-cache-dir", default=None, metavar="DIR",
                   help="a third KV tier on local disk below --swap-space (files kept "
                        "across restarts; default off)")
    e.add_argument("--disk-cache-size", type=parse_size, default=0, metavar="SIZE",
                   help="bytes the disk tier may use, e.g. 20GiB, 500MB")
    e.add_argument("--preemption-mode", default="recompute", help="recompute | swap")
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=2048)
    e.add_argument("--max-prefill-tokens-with-decodes", type=int, default=128, metavar="P",
                   help="prompt tokens a step that also decodes may compute (default 128: "
                        "arrivals are prefilled in arrival order beside the running "
                        "decodes, each in even chunks of at most P; P more for every 2 "
                        "requests waiting; 0: up to --max-num-batched-tokens, as vLLM)")
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--kv-layout", default="paged", help="paged | contiguous (baseline)")
    e.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="run the model eagerly. Default: on CUDA, decode steps replay CUDA "
                        "graphs (one captured per batch-size bucket on first use); on CPU, "
                        "eager. --no-enforce-eager: on CPU too, torch.compile the decode "
                        "forward per padded batch size (a one-off compile of ~15-50 s per "
                        "bucket on first use)")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="split the model over N ranks (gloo on CPU, NCCL on CUDA)")
    p.set_defaults(func=_run)


ENGINE_FLAGS = ("model", "load_format", "device", "dtype", "seed", "block_size", "num_gpu_blocks",
                "kv_cache_memory_bytes", "gpu_memory_utilization", "kv_cache_dtype",
                "enable_prefix_caching", "eviction_policy", "swap_space", "preemption_mode",
                "max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_layout",
                "tensor_parallel_size", "kv_demotion", "kv_hot_window",
                "max_prefill_tokens_with_decodes", "enforce_eager", "disk_cache_dir",
                "disk_cache_size", "disable_hybrid_kv_cache_manager")


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


MAX_SIZE = 1 << 60  # 1 EiB: more than any disk; a bigger size is a typo, said so


def parse_size(text: str) -> int:
    """Bytes from "20GiB", "500MB", "1.5 GiB" or a plain number, at most ``MAX_SIZE``.
    Exact for integers (no float rounding); anything else is a clear ArgumentTypeError,
    never an OverflowError."""
    m = re.fullmatch(r"\s*([0-9]+)(?:\.([0-9]*))?\s*([a-zA-Z]*)\s*", text)
    if m is None or m.group(3).lower() not in _UNITS or len(m.group(1)) > 30:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size (a number and one of B, KB, MB, GB, TB, KiB, MiB, GiB, "
            "TiB)")
    unit = _UNITS[m.group(3).lower()]
    frac = (m.group(2) or "")[:30]
    # integer arithmetic: a 400-digit number must not become float('inf')
    size = int(m.group(1)) * unit + (int(frac) * unit // 10 ** len(frac) if frac else 0)
    if size > MAX_SIZE:
        raise argparse.ArgumentTypeError(
            f"{text!r} is {size:.3g} bytes; a size may be at most 1 EiB ({MAX_SIZE} bytes)")
    return size


def model_of(args: argparse.Namespace) -> str:
    """The model to serve: the positional MODEL (vLLM's form) or --model, not two different
    ones; smollm2 when neither is given."""
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"two models given ({args.model_tag!r} and --model {args.model!r}); "
                         "give one")
    return args.model_tag or args.model or "smollm2"


def engine_config(args: argparse.Namespace) -> Any:
    """The EngineConfig the flags describe (ValueError/TypeError for a bad one)."""
    from kvscope.engine.config import EngineConfig

    return EngineConfig.from_kwargs(**{k: getattr(args, k) for k in ENGINE_FLAGS},
                                    events_endpoint=args.events, record_path=args.record,
                                    events_keys=args.events_keys,
                                    kv_events_config=args.kv_events_config)


def server_settings(args: argparse.Namespace) -> Any:
    """The daemon's ServerSettings the flags describe (after ``_run``'s checks)."""
    from kvscope.engine.server.state import ServerSettings

    return ServerSettings(served_model_name=args.served_model_name or args.model,
                          api_key=args.api_key, max_body_bytes=args.max_body_bytes,
                          max_n=args.max_n, drain_timeout_s=args.drain_timeout,
                          metrics_prefix=args.metrics_prefix,
                          max_logprobs=args.max_logprobs,
                          tool_parser=args.tool_call_parser
                          if args.enable_auto_tool_choice else None,
                          chat_template=args.chat_template)


def _run(args: argparse.Namespace) -> int:
    import sys

    from kvscope.engine.server.daemon import run_daemon

    try:
        args.model = model_of(args)
    except ValueError as e:
        print(f"kvscope serve: {e}", file=sys.stderr)
        return 2
    try:
        config = engine_config(args)
    except (ValueError, TypeError) as e:
        print(f"kvscope serve: {e}", file=sys.stderr)
        return 2
    if args.max_n < 1 or args.max_body_bytes < 1 or args.drain_timeout < 0 or \
            args.max_logprobs < 0:
        print("kvscope serve: --max-n and --max-body-bytes must be >= 1, "
              "--drain-timeout and --max-logprobs >= 0", file=sys.stderr)
        return 2
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        print("kvscope serve: --enable-auto-tool-choice needs --tool-call-parser (hermes or "
              "llama3_json: the model family's tool-call syntax)", file=sys.stderr)
        return 2
    if args.chat_template is not None:
        from kvscope.engine.model.chat_template import load_chat_template

        try:
            args.chat_template = load_chat_template(args.chat_template)
        except (ValueError, OSError) as e:
            print(f"kvscope serve: {e}", file=sys.stderr)
            return 2
    if args.data_parallel_size != 1:
        if args.data_parallel_size < 1:
            print("kvscope serve: --data-parallel-size must be >= 1", file=sys.stderr)
            return 2
        from kvscope.engine.router.data_parallel import run_data_parallel

        return run_data_parallel(args)
    return run_daemon(config, server_settings(args), args.host, args.port, args.log_level)
