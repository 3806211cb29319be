"""`kvscope export REC --format perfetto -o run.json` (Chrome trace-event JSON: a track
per sequence with its lifecycle, counter tracks for the cache) or `--format csv -o DIR`
(DIR/steps.csv: per-step stats; DIR/requests.csv: the per-request table)."""

from __future__ import annotations

import argparse
import sys

FORMATS = ("perfetto", "csv")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a recording as a Perfetto trace or CSV tables")
    p.add_argument("recording", help="a .kvtrace file (kvscope record / serve --record)")
    p.add_argument("--format", choices=FORMATS, default="perfetto",
                   help="perfetto: trace-event JSON for ui.perfetto.dev; csv: two tables")
    p.add_argument("-o", "--output", required=True,
                   help="perfetto: the .json file to write; csv: a directory")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.events.analysis.export import write_csv, write_perfetto
    from engine.events.analysis.lifecycle import LifecycleIndex
    from engine.events.wire.recording import Recording, RecordingError

    try:
        with Recording(args.recording) as rec:
            idx = LifecycleIndex.for_recording(rec)
            header = {k: v for k, v in rec.header.items() if isinstance(v, (str, int, float))}
    except RecordingError as e:
        print(f"kvscope export: {e}", file=sys.stderr)
        return 2
    try:
        if args.format == "perfetto":
            n = write_perfetto(idx, args.output, {"recording": str(args.recording), **header})
            print(f"wrote {n} trace events ({len(idx.order)} sequence tracks) to "
                  f"{args.output}; open it in https://ui.perfetto.dev")
        else:
            steps, reqs = write_csv(idx, args.output)
            print(f"wrote {steps} ({len(idx.steps['step'])} steps) and {reqs} "
                  f"({len(idx.order)} sequences)")
    except OSError as e:
        print(f"kvscope export: cannot write {args.output}: {e.strerror}", file=sys.stderr)
        return 1
    return 0
