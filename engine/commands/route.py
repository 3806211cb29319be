"""`kvscope route`: a prefix-aware router in front of several `kvscope serve` replicas.

    kvscope route --replica http://127.0.0.1:8001,tcp://127.0.0.1:5557 \
                  --replica http://127.0.0.1:8002,tcp://127.0.0.1:5559 \
                  [--policy prefix|least-load|round-robin] [--port 8000] [--model smollm2]

Each replica is ``URL[,EVENTS[,SNAPSHOT]]``: its HTTP address and its event stream
(``kvscope serve --events``; the snapshot endpoint defaults to the events port + 1).
Without an event stream a replica is routed by load only.
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("route", help="route OpenAI requests over several replicas by their "
                                     "cached prefixes")
    from kvscope.engine.router.build import add_router_args

    add_router_args(p)
    p.add_argument("--replica", action="append", default=[], metavar="URL[,EVENTS]",
                   required=True, help="a replica: its HTTP URL and event endpoint (repeat)")
    p.add_argument("--keys", metavar="DIR", default=None,
                   help="CURVE keys (`kvscope keys DIR`) for replicas serving with "
                        "--events-keys")
    p.add_argument("--model", default="smollm2",
                   help="the replicas' model, for its tokenizer and chat template")
    p.add_argument("--chat-template", default=None, metavar="PATH_OR_TEMPLATE",
                   help="the replicas' --chat-template, if they were given one")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: pick a free one)")
    p.add_argument("--log-level", default="warning",
                   choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    import asyncio
    import sys

    from kvscope.engine.router.build import build_router
    from kvscope.engine.server.daemon import bind_socket

    router, err = build_router(args.replica, args.policy, args.load_cost_tokens, args.model,
                               args.chat_template, keys=args.keys)
    if router is None:
        print(f"kvscope route: {err}", file=sys.stderr)
        return 2
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"kvscope route: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]
    from kvscope.engine.router.serve import serve_router

    line = (f"kvscope route: ready on http://{host}:{port} ({len(router.replicas)} "
            f"replicas, policy {args.policy})")
    try:
        asyncio.run(serve_router(router, sock, args.log_level, line))
    finally:
        sock.close()
    print("kvscope route: stopped", file=sys.stderr, flush=True)
    return 0
