"""`kvscope inspect`: open the Qt inspector on a recording (replay) or a live engine.

    kvscope inspect                        the bundled sample recording
    kvscope inspect run.kvtrace            replay a recording
    kvscope inspect --connect tcp://127.0.0.1:5557    attach to a running engine
    kvscope inspect --connect tcp://HOST:5557 --keys DIR   one that uses CURVE keys
    kvscope inspect run.kvtrace --screenshot out.png [--step N]    render offscreen, exit
    kvscope inspect --connect-vllm tcp://127.0.0.1:5557   a vLLM/SGLang publisher that binds
    kvscope inspect --listen-vllm tcp://127.0.0.1:5557    one that connects (vLLM does, for
                                                          a concrete tcp://host:port)
    kvscope inspect capture.vllmtrace      replay a recorded vLLM-format stream
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
    p.add_argument("--keys", metavar="DIR", default=None,
                   help="with --connect: CURVE keys (`kvscope keys DIR`; needs server.key and "
                        "client.key_secret) for an engine serving with --events-keys")
    p.add_argument("--screenshot", metavar="PNG", default=None,
                   help="render offscreen, save a PNG of the window and exit")
    p.add_argument("--step", type=int, default=None,
                   help="with a recording: show this engine step (default: the last)")
    p.add_argument("--wait", type=float, default=5.0,
                   help="with --connect --screenshot: seconds to watch the live stream "
                        "before saving (its state must arrive within them)")
    v = p.add_argument_group("vLLM-format KV events (vLLM, SGLang, kvscope --kv-events-config)")
    v.add_argument("--connect-vllm", metavar="ENDPOINT", default=None,
                   help="connect to a publisher that binds (vLLM endpoint tcp://*:N or ipc)")
    v.add_argument("--listen-vllm", metavar="ENDPOINT", default=None,
                   help="bind here for a publisher that connects (vLLM given tcp://host:N)")
    v.add_argument("--vllm-replay", metavar="ENDPOINT", default=None,
                   help="the publisher's replay_endpoint: fills seq gaps")
    v.add_argument("--vllm-topic", default="", help="the publisher's topic (default '')")
    v.add_argument("--record-vllm", metavar="PATH", default=None,
                   help="also record the stream to a .vllmtrace file (replay: inspect PATH)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    vllm = args.connect_vllm or args.listen_vllm
    if sum(map(bool, (args.connect, args.recording, vllm))) > 1 or (
            args.connect_vllm and args.listen_vllm):
        print("kvscope inspect: give one of a recording, --connect, --connect-vllm or "
              "--listen-vllm")
        return 2
    if args.keys and not args.connect:
        print("kvscope inspect: --keys goes with --connect (a kvscope publisher)")
        return 2
    if vllm or any(r.endswith(".vllmtrace") for r in args.recording or []):
        from kvscope.inspector.vllm_app import run_vllm  # Qt loads only here

        return run_vllm(endpoint=vllm, bind=bool(args.listen_vllm),
                        replay_endpoint=args.vllm_replay, topic=args.vllm_topic,
                        record_path=args.record_vllm,
                        recording=None if vllm else args.recording[0],
                        screenshot=args.screenshot, wait_s=args.wait,
                        until_seq=args.step)  # a vLLM recording's "step" is its seq
    connect, recordings = args.connect or [], args.recording or []
    if len(connect) > 1 or len(recordings) > 1 or \
            any(c.startswith(("http://", "https://")) for c in connect):
        from kvscope.inspector.fleet import run_fleet  # several replicas side by side

        return run_fleet(recordings, connect, screenshot=args.screenshot, wait_s=args.wait,
                         events_keys=args.keys)
    from kvscope.inspector.app import run  # Qt loads only here

    return run(recording=recordings[0] if recordings else None,
               connect=connect[0] if connect else None, screenshot=args.screenshot,
               step=args.step, wait_s=args.wait, snapshot_endpoint=args.snapshot_endpoint,
               keys=args.keys)
