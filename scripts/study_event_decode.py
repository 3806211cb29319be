"""How fast the subscriber decodes a batch: the codec before typed events (msgpack +
envelope checks only) against what ``Codec.decode`` does now (msgspec decoding straight
into the event types, every field checked) and its checked path (msgpack, then every
event converted to its type), on the same encoded batches, in one process.

    python scripts/study_event_decode.py [--steps 2000] [--rounds 15]

Two mixes: "realistic" (the real KVCacheManager under ``ManagerWorkload``, what an
engine emits) and "synthetic" (``engine.bench.synthetic``: swaps, offloads, causes, big
batches). The variants run in turn, round after round; each reports its best round in
CPU time (``time.process_time``), per event. Not a test and not in ``kvscope bench``: a
study that backs the choice of decoder.
"""

from __future__ import annotations

import argparse
import gc
import time

import msgpack

from kvscope.engine.bench.event_workloads import make_batches, realistic_batches
from kvscope.engine.events.wire import codec as C


def before(frames: list[bytes]) -> None:
    """The codec before typed events: msgpack, then the envelope checks."""
    for f in frames:
        C.check_envelope(msgpack.unpackb(f, raw=False, strict_map_key=True, use_list=True))


def checked(frames: list[bytes]) -> None:
    codec = C.Codec()
    for f in frames:
        codec.decode_checked(f)


def typed(frames: list[bytes]) -> None:
    codec = C.Codec()
    for f in frames:
        codec.decode(f)


VARIANTS = {"before: msgpack + envelope": before,
            "now: Codec.decode (msgspec, typed)": typed,
            "now: checked path (msgpack + convert)": checked}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    codec = C.Codec()
    mixes = {"realistic": realistic_batches(args.steps),
             "synthetic": make_batches(args.steps, seed=3)}
    for mix, batches in mixes.items():
        frames = [codec.encode(C.make_batch("study", i + 1, i, 0.0,
                                            C.pack_events([dict(e) for e in ev]), st))
                  for i, (ev, st) in enumerate(batches)]
        n = sum(len(ev) for ev, _ in batches)
        assert all(codec.decode(f) == codec.decode_checked(f) for f in frames)
        best = dict.fromkeys(VARIANTS, float("inf"))
        for _ in range(args.rounds):
            for name, fn in VARIANTS.items():
                gc.collect()
                t0 = time.process_time()
                fn(frames)
                best[name] = min(best[name], time.process_time() - t0)
        print(f"{mix}: {len(frames)} batches, {n} events, "
              f"{sum(map(len, frames)) // len(frames)} bytes per batch")
        base = best["before: msgpack + envelope"]
        for name, t in best.items():
            print(f"  {name:40s} {t / n * 1e6:6.3f} us/event  x{t / base:.2f}")


if __name__ == "__main__":
    main()
