"""vLLM's own state in kvscope's canonical form, read straight from vLLM's structures
(the reference the plugin's stream is compared with; see sitecustomize.py)."""

from __future__ import annotations

import functools
import json
import os


def vllm_state(scheduler) -> dict:
    from vllm.v1.request import RequestStatus

    kvm = scheduler.kv_cache_manager
    pool = kvm.block_pool
    ref, hashes = [], []
    for b in pool.blocks:
        ref.append(1 if b.is_null else b.ref_cnt)
        key = b.block_hash
        if key is None:
            hashes.append(None)
        else:  # vLLM's int hash form (low 64 bits, big-endian) as a signed int64
            h = int.from_bytes(bytes(key[:-4]), "big") % (1 << 64)
            hashes.append(h - (1 << 64) if h >= 1 << 63 else h)
    managers = kvm.coordinator.single_type_managers
    seqs = {}
    reserved = [pool.null_block.block_id]
    for rid, r in scheduler.requests.items():
        if RequestStatus.is_finished(r.status):
            continue
        for g, m in enumerate(managers):
            sid = rid if g == 0 else f"{rid}/g{g}"
            seqs[sid] = {
                "status": "running" if r.status == RequestStatus.RUNNING else "waiting",
                "tier": "gpu",
                "block_table": [b.block_id for b in m.req_to_blocks.get(rid, ())
                                if not b.is_null],
                "num_tokens": r.num_computed_tokens}
    for g, m in enumerate(managers):
        for rid, blocks in m.req_to_blocks.items():
            if rid not in seqs and (g == 0 or f"{rid}/g{g}" not in seqs):
                reserved += [b.block_id for b in blocks if not b.is_null]
    for _, blocks in getattr(scheduler, "deferred_frees", ()):
        reserved += [b.block_id for b in blocks if not b.is_null]
    seqs["vllm:reserved"] = {"status": "running", "tier": "gpu",
                             "block_table": sorted(reserved), "num_tokens": 0}
    return {"tiers": {"gpu": {"num_blocks": len(pool.blocks),
                              "block_size": managers[0].kv_cache_spec.block_size,
                              "format": "auto", "ref": ref, "hash": hashes,
                              "block_formats": {}}},
            "seqs": dict(sorted(seqs.items()))}


def install(path: str) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    update, finish = Scheduler.update_from_output, Scheduler.finish_requests

    def write(scheduler, what: str) -> None:
        line = {"pid": os.getpid(), "at": what, "state": vllm_state(scheduler)}
        reader = getattr(getattr(scheduler, "_kvscope", None), "reader", None)
        if reader is not None:  # the plugin's reads so far (this batch's not yet)
            reader.check_every = 4  # its full-read check, often enough to run here
            line["reads"] = {k: getattr(reader, k)
                             for k in ("steps", "full_reads", "checks", "mismatches")}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    # functools.wraps: the plugin (loaded after this) reads the wrapped method's signature
    @functools.wraps(update)
    def update_from_output(self, *args, **kw):
        out = update(self, *args, **kw)
        write(self, "step")
        return out

    @functools.wraps(finish)
    def finish_requests(self, *args, **kw):
        out = finish(self, *args, **kw)
        if getattr(self, "_kvscope", None) is not None:  # the plugin closes a batch too
            write(self, "finish")
        return out

    Scheduler.update_from_output = update_from_output
    Scheduler.finish_requests = finish_requests
