"""`kvscope export REC --format perfetto -o run.json` (Chrome trace-event JSON: a track
per sequence with its lifecycle, counter tracks for the cache) or `--format csv -o DIR`
(DIR/steps.csv: per-step stats; DIR/requests.csv: the per-request table).

Exit codes: 0 written; 1 written in part (a damaged frame ends the recording early: the
steps before it are written, the reason is one line on stderr) or not writable; 2 nothing
to export (not a recording, or one without steps)."""

from __future__ import annotations

import argparse
import sys
import warnings

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
    from kvscope.engine.events.analysis.export import write_csv, write_perfetto
    from kvscope.engine.events.analysis.lifecycle import LifecycleIndex
    from kvscope.engine.events.wire.recording import Recording, RecordingError, RecordingWarning

    try:
        with warnings.catch_warnings(), Recording(args.recording) as rec:
            # said once below, on one line (a damaged frame: rec.damage)
            warnings.simplefilter("ignore", RecordingWarning)
            if not rec.steps:
                raise RecordingError(f"{rec.path}: the recording holds no engine steps")
            idx = LifecycleIndex.for_recording(rec)
            header = {k: v for k, v in rec.header.items() if isinstance(v, (str, int, float))}
            damage = rec.damage
            if not len(idx.steps["step"]):
                raise RecordingError(damage or f"{rec.path}: the recording holds no engine "
                                                "steps")
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
    if damage is not None:  # what was written is the part before the damage
        print(f"kvscope export: partial: {damage}", file=sys.stderr)
        return 1
    return 0
