"""`kvscope record --connect ENDPOINT -o run.kvtrace [--duration S]`: record a live
event stream (a running engine's EventStream) to a recording file.

The recording starts at the subscriber's first snapshot (a keyframe) and follows the
stream; a resync (after lost batches) writes a keyframe. A publisher restart (new epoch:
steps start again at 0) ends the recording, since one file holds one engine run.
"""

from __future__ import annotations

import argparse
import sys
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("record", help="record a live event stream to a .kvtrace file")
    p.add_argument("--connect", required=True, metavar="ENDPOINT",
                   help="the engine's event endpoint, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--snapshot-endpoint", default=None, metavar="ENDPOINT",
                   help="snapshot/replay endpoint (default: the --connect port + 1)")
    p.add_argument("--keys", metavar="DIR", default=None,
                   help="CURVE keys (`kvscope keys DIR`) for an engine serving with "
                        "--events-keys")
    p.add_argument("-o", "--output", required=True, help="the .kvtrace file to write")
    p.add_argument("--duration", type=float, default=None, metavar="S",
                   help="stop after S seconds (default: until Ctrl-C or a publisher restart)")
    p.add_argument("--keyframe-every-steps", type=int, default=200)
    p.add_argument("--keyframe-every-s", type=float, default=10.0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvscope.engine.events.wire.recording import RecordingWriter
    from kvscope.engine.events.wire.subscriber import Subscriber

    writer: RecordingWriter | None = None
    epoch: list[str] = []
    restarted = []

    def on_apply(update: dict, state) -> None:
        nonlocal writer
        if update["type"] == "snapshot":
            if writer is None:
                epoch.append(update["epoch"])
                writer = RecordingWriter(
                    args.output, {**update.get("info", {}), "epoch": update["epoch"],
                                  "source": args.connect},
                    keyframe_every_steps=args.keyframe_every_steps,
                    keyframe_every_s=args.keyframe_every_s)
            elif update["epoch"] != epoch[0]:
                restarted.append(update["epoch"])
                return
            writer.keyframe(state, update["seq"], update["epoch"])
        elif writer is not None and not restarted:
            writer.add(update, state)

    try:
        sub = Subscriber(args.connect, args.snapshot_endpoint, on_apply=on_apply,
                         keys=args.keys)
    except ValueError as e:  # unreadable keys, a malformed endpoint
        print(f"kvscope record: {e}", file=sys.stderr)
        return 2
    start = time.monotonic()
    try:
        while not restarted and (args.duration is None
                                 or time.monotonic() - start < args.duration):
            sub.poll(0.1)
    except KeyboardInterrupt:
        pass
    finally:
        sub.close()
        if writer is not None:
            writer.close()
    if writer is None:
        why = sub.problem or "is an engine publishing there?"
        print(f"kvscope record: no snapshot from {args.connect} ({why})", file=sys.stderr)
        return 1
    why = " (publisher restarted)" if restarted else ""
    print(f"recorded {sub.batches_applied} batches, {writer.bytes_written} bytes "
          f"to {args.output}{why}; gaps {sub.gaps}, resyncs {sub.resyncs}, "
          f"errors {sub.errors}")
    return 0
