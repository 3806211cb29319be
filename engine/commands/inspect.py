"""`kvscope inspect`: open the Qt inspector on a recording (replay) or a live engine.

    kvscope inspect                        the bundled sample recording
    kvscope inspect run.kvtrace            replay a recording
    kvscope inspect --connect tcp://127.0.0.1:5557    attach to a running engine
    kvscope inspect run.kvtrace --screenshot out.png [--step N]    render offscreen, exit
    kvscope inspect --connect A --connect B    the fleet view: replicas side by side
    kvscope inspect --connect http://ROUTER    the same, the router's replicas and figures
    kvscope inspect r0.kvtrace r1.kvtrace      recordings of several replicas, one time axis
"""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("inspect", help="draw the KV cache live or from a recording (Qt)")
    p.add_argument("recording", nargs="*", default=None,
                   help="a .kvtrace recording (default: the bundled sample); several: the "
                        "fleet view, replayed together on one time axis")
    p.add_argument("--connect", metavar="ENDPOINT", action="append", default=None,
                   help="attach to a live engine's event publisher, e.g. tcp://127.0.0.1:5557;"
                        " repeat it, or give a router's http:// address, for the fleet view")
    p.add_argument("--snapshot-endpoint", metavar="ENDPOINT", default=None,
                   help="the engine's snapshot/replay endpoint (default: --connect's port + 1)")
    p.add_argument("--screenshot", metavar="PNG", default=None,
                   help="render offscreen, save a PNG of the window and exit")
    p.add_argument("--step", type=int, default=None,
                   help="with a recording: show this engine step (default: the last)")
    p.add_argument("--wait", type=float, default=5.0,
                   help="with --connect --screenshot: seconds to wait for the engine's state")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.connect and args.recording:
        print("kvscope inspect: give a recording or --connect, not both")
        return 2
    connect, recordings = args.connect or [], args.recording or []
    if len(connect) > 1 or len(recordings) > 1 or \
            any(c.startswith(("http://", "https://")) for c in connect):
        from inspector.fleet import run_fleet  # several replicas side by side

        return run_fleet(recordings, connect, screenshot=args.screenshot, wait_s=args.wait)
    from inspector.app import run  # Qt loads only here

    return run(recording=recordings[0] if recordings else None,
               connect=connect[0] if connect else None, screenshot=args.screenshot,
               step=args.step, wait_s=args.wait, snapshot_endpoint=args.snapshot_endpoint)
