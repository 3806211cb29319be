"""kvscope inside vLLM: a ``vllm.general_plugins`` entry point that publishes and/or
records a running vLLM's whole page table in kvscope's own protocol.

    KVSCOPE_EVENTS=tcp://127.0.0.1:5557 vllm serve ...   # publish (kvscope inspect --connect)
    KVSCOPE_RECORD=run.kvtrace vllm serve ...            # record (kvscope inspect run.kvtrace)

Inert unless one of the two is set: ``register`` then returns before importing anything
of vLLM, patches nothing and starts no thread. When set, it checks vLLM by capability, not
by version string: every method it wraps must exist with the parameters its wrapper reads
where the wrapper reads them (``SIGNATURES``, by ``inspect.signature``), and vLLM's block
must have the fields the reader reads (``BLOCK_FIELDS``). On any difference it logs one
warning and patches nothing, so it never breaks vLLM. Checked against vLLM 0.32 and 0.33
(``CHECKED``); what differs between them and how the reader takes it is in docs/vllm.md.

What it wraps (methods of vLLM's classes, never the classes themselves, so names other
modules imported keep working): ``Scheduler.update_from_output`` (the end of an engine-
core step: the page table is read there, ``engine.events.vllm.pagetable``, and one batch
closes), ``Scheduler.finish_requests`` (aborts between steps close a batch too),
``Scheduler._preempt_request`` (the preemption's cause) and
``BlockPool.reset_prefix_cache`` (evictions caused by a reset), the ``BlockPool``
methods that change a block's ref count or hash (``TRACKED``: they note the block ids
they were handed, so a step re-reads only those, engine.events.vllm.tracker; the full
read checks the tracker every ``CHECK_EVERY`` steps), and
``Scheduler.shutdown`` when there is one (the stream closes: the recording's index is
written). vLLM loads general
plugins in every process (front end, engine core, workers); only the engine core has a
scheduler, so only it opens the stream, at its first step. A data-parallel vLLM (one
engine core per rank) gets one stream per rank: rank r publishes on the port + r and
records to ``<name>.rank<r><suffix>``.

A failure inside the plugin at a step is logged once and turns the plugin off for the
rest of the run (the stream is closed); vLLM goes on. Its two outputs fail alone: a
recording path that cannot be opened leaves the publisher on, a busy port leaves the
recording on (``open_outputs``), and a recording that fails mid-run (a full disk) stops
alone while the stream goes on publishing (engine.events.wire.stream).
"""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvscope.engine.events import causes as C
from kvscope.engine.events.vllm.pagetable import PageTableDiffer
from kvscope.engine.events.vllm.tracker import IncrementalReader, Touched

log = logging.getLogger("kvscope.vllm")

ENV_EVENTS = "KVSCOPE_EVENTS"  # endpoint to publish on (what `kvscope serve --events` takes)
ENV_RECORD = "KVSCOPE_RECORD"  # recording path (.kvtrace)
ENV_KEYS = "KVSCOPE_EVENTS_KEYS"  # CURVE key dir (`kvscope keys DIR`): needed off loopback
# vLLM versions the plugin was run against (its fidelity tests); informative only: what
# decides is the capability check below, so a later vLLM whose wrapped methods kept their
# shape is read too, and one whose methods changed is left alone
CHECKED = ("0.32.0", "0.33.0")
PLUGIN_NAME = "kvscope"
# BlockPool methods that change blocks' ref counts or hashes, each with how its blocks
# are found: "result" (the list it returns), or the name of the parameter holding a
# block or blocks (positional index after self, keyword name)
TRACKED = {
    "get_new_blocks": ("result", None),
    "touch": (0, "blocks"),
    "free_blocks": (0, "ordered_blocks"),
    "unpin_blocks": (0, "blocks"),
    "_insert_block_hash": (1, "block"),
    "_remove_cached_block_hashes": (0, "block"),
}
# Every method the plugin wraps, with the leading parameters (after self, in positional
# order) that its wrapper reads or that TRACKED names; further parameters are vLLM's own
# and forwarded untouched (*args, **kwargs). Same in vLLM 0.32 and 0.33.
SIGNATURES: dict[tuple[str, str], tuple[str, ...]] = {
    ("Scheduler", "update_from_output"): ("scheduler_output",),
    ("Scheduler", "finish_requests"): (),
    ("Scheduler", "_preempt_request"): ("request",),
    ("BlockPool", "reset_prefix_cache"): (),
    ("BlockPool", "get_new_blocks"): ("num_blocks",),
    ("BlockPool", "touch"): ("blocks",),
    ("BlockPool", "free_blocks"): ("ordered_blocks",),
    ("BlockPool", "unpin_blocks"): ("blocks",),
    ("BlockPool", "_insert_block_hash"): ("block_hash_with_group_id", "block"),
    ("BlockPool", "_remove_cached_block_hashes"): ("block",),
}
# What the page-table reader reads of vLLM's KVCacheBlock (pagetable.py, tracker.py)
BLOCK_FIELDS = ("block_id", "ref_cnt", "_block_hash", "is_null")
# Things vLLM cannot tell a scheduler-side observer; the inspector names them.
UNSEEN = ("KV moved by offloading connectors on the workers",
          "blocks of pools other than the scheduler's main BlockPool")


class Config:
    """The plugin's configuration, from the environment."""

    def __init__(self, environ: dict[str, str] | os._Environ = os.environ) -> None:
        self.endpoint = environ.get(ENV_EVENTS) or None
        self.record = environ.get(ENV_RECORD) or None
        self.keys = environ.get(ENV_KEYS) or None

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None or self.record is not None

    def for_rank(self, rank: int) -> Config:
        """Rank r of a data-parallel vLLM: its own port and recording."""
        out = Config({})
        out.endpoint, out.record, out.keys = self.endpoint, self.record, self.keys
        if rank and out.endpoint:
            head, _, port = out.endpoint.rpartition(":")
            if port.isdigit():
                out.endpoint = f"{head}:{int(port) + rank}"
        if rank and out.record:
            p = Path(out.record)
            out.record = str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))
        return out


_state: dict[str, Any] = {"patched": False}


def register() -> None:
    """vLLM's entry point (``vllm.general_plugins``). Never raises."""
    cfg = Config()
    if not cfg.enabled or _state["patched"] or _state.get("refused"):
        return  # refused: warned once in this process already
    try:
        import vllm
        version = str(getattr(vllm, "__version__", "?"))
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.request import RequestStatus
    except Exception as e:  # noqa: BLE001 - a plugin must never break vLLM
        _state["refused"] = True
        log.warning("kvscope: cannot read vLLM (%s); the kvscope plugin stays off", e)
        return
    try:
        from vllm.v1.core.kv_cache_utils import KVCacheBlock
    except Exception:  # noqa: BLE001 - reported by differences() as a missing block type
        KVCacheBlock = None
    try:
        diffs = differences({"Scheduler": Scheduler, "BlockPool": BlockPool}, KVCacheBlock)
    except Exception as e:  # noqa: BLE001 - whatever vLLM holds there, stay off
        diffs = [f"its classes could not be read ({e!r})"]
    if not hasattr(RequestStatus, "RUNNING"):
        diffs.append("RequestStatus.RUNNING is missing")
    if diffs:
        _state["refused"] = True
        log.warning("kvscope: vLLM %s differs from what the kvscope plugin reads (%s; "
                    "checked against vLLM %s); the kvscope plugin stays off", version,
                    "; ".join(diffs), ", ".join(CHECKED))
        return
    _patch(Scheduler, BlockPool, RequestStatus.RUNNING, cfg, version)
    _state["patched"] = True


def differences(classes: dict[str, Any], block_cls: Any) -> list[str]:
    """How vLLM's classes differ from what the plugin wraps and reads (``SIGNATURES``,
    ``BLOCK_FIELDS``): one line per difference; [] when the plugin can run."""
    out: list[str] = []
    for (where, name), wanted in SIGNATURES.items():
        method = getattr(classes[where], name, None)
        if not callable(method):
            out.append(f"{where}.{name} is missing")
            continue
        try:
            params = list(inspect.signature(method).parameters.values())
        except (TypeError, ValueError):
            out.append(f"{where}.{name} has no readable signature")
            continue
        positional = [p.name if p.kind != p.VAR_POSITIONAL else "*" + p.name
                      for p in params[1:] if p.kind in (
                          p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
        if positional[:len(wanted)] != list(wanted):
            # *args: a wrapper (another plugin's) that does not say what it wraps
            # (functools.wraps sets __wrapped__, which inspect.signature follows)
            got = ", ".join(positional[:len(wanted)] or ["nothing"])
            out.append(f"{where}.{name} takes ({got}) where the plugin reads "
                       f"({', '.join(wanted)})")
    if block_cls is None:
        out.append("vllm.v1.core.kv_cache_utils.KVCacheBlock is missing")
    else:
        try:
            have = {f.name for f in dataclasses.fields(block_cls)}
        except TypeError:
            have = set(getattr(block_cls, "__annotations__", ()))
        lacking = [f for f in BLOCK_FIELDS if f not in have]
        if lacking:
            out.append(f"KVCacheBlock lacks {', '.join(lacking)}")
    return out


def _patch(scheduler_cls: Any, pool_cls: Any, running: Any, cfg: Config,
           version: str) -> None:
    update = scheduler_cls.update_from_output
    finish = scheduler_cls.finish_requests
    preempt = scheduler_cls._preempt_request
    reset = pool_cls.reset_prefix_cache

    def update_from_output(self: Any, scheduler_output: Any, *args: Any, **kw: Any) -> Any:
        out = update(self, scheduler_output, *args, **kw)
        _producer(self, cfg, running, version).end_step(
            self, getattr(scheduler_output, "total_num_scheduled_tokens", None))
        return out

    def finish_requests(self: Any, *args: Any, **kw: Any) -> Any:
        out = finish(self, *args, **kw)
        p = getattr(self, "_kvscope", None)
        if p is not None:  # only once the engine has stepped (the stream exists)
            p.end_step(self, 0)
        return out

    def _preempt_request(self: Any, request: Any, *args: Any, **kw: Any) -> Any:
        p = getattr(self, "_kvscope", None)
        if p is not None and p.on:
            p.note_preemption(self, request)
        return preempt(self, request, *args, **kw)

    def reset_prefix_cache(self: Any, *args: Any, **kw: Any) -> Any:
        ok = reset(self, *args, **kw)
        for p in list(_producers):
            if ok and p.pool is self:
                p.differ.reset_pending = True
                p.touched.all = True
        return ok

    for name, (where, kw_name) in TRACKED.items():
        setattr(pool_cls, name, _tracking(getattr(pool_cls, name), where, kw_name))

    shutdown = getattr(scheduler_cls, "shutdown", None)
    if callable(shutdown):
        def scheduler_shutdown(self: Any, *args: Any, **kw: Any) -> Any:
            p = getattr(self, "_kvscope", None)
            if p is not None:
                p.close()  # the recording's index is written; subscribers see it end
            return shutdown(self, *args, **kw)

        scheduler_cls.shutdown = scheduler_shutdown
    scheduler_cls.update_from_output = update_from_output
    scheduler_cls.finish_requests = finish_requests
    scheduler_cls._preempt_request = _preempt_request
    pool_cls.reset_prefix_cache = reset_prefix_cache


def _tracking(method: Any, where: int | str, kw_name: str | None) -> Any:
    """``method`` of vLLM's BlockPool, noting the ids of the blocks it is handed (or
    returns) in the pool's ``_kvscope_touched`` when a producer set one (else as is)."""
    def wrapper(self: Any, *args: Any, **kw: Any) -> Any:
        touched = getattr(self, "_kvscope_touched", None)
        if touched is None:
            return method(self, *args, **kw)
        if where == "result":
            out = method(self, *args, **kw)
            try:
                _note(self, touched, out)
            except Exception:  # noqa: BLE001
                touched.all = True
            return out
        if kw_name in kw:
            arg = kw[kw_name] = _listed(kw[kw_name])
        elif isinstance(where, int) and where < len(args):
            args = (*args[:where], _listed(args[where]), *args[where + 1:])
            arg = args[where]
        else:  # a call shape this version of the wrapper does not know
            touched.all = True
            return method(self, *args, **kw)
        try:
            _note(self, touched, arg)
        except Exception:  # noqa: BLE001 - never break vLLM: the next step reads all
            touched.all = True
        return method(self, *args, **kw)

    wrapper.__name__ = wrapper.__qualname__ = getattr(method, "__name__", "wrapper")
    wrapper.__wrapped__ = method
    return wrapper


def _listed(blocks: Any) -> Any:
    """A one-pass iterable as a list (so both vLLM and the note can read it)."""
    return blocks if isinstance(blocks, list | tuple) or hasattr(blocks, "block_id") \
        else list(blocks)


def _note(pool: Any, touched: Touched, blocks: Any) -> None:
    if hasattr(blocks, "block_id"):
        blocks = (blocks,)
    ids = touched.ids
    for b in blocks:
        if isinstance(b, list | tuple):  # one list per KV cache group
            _note(pool, touched, b)
        elif getattr(b, "pool", None) in (None, pool):  # blocks of other pools: not ours
            ids.add(b.block_id)


_producers: list[Producer] = []


def open_outputs(stream_cls: Any, cfg: Config, **kw: Any) -> Any:
    """The stream for ``cfg``'s outputs (``stream_cls(endpoint, record, **kw)``). When
    both are asked for and one cannot open (a busy port, a recording path that cannot be
    written), the other runs alone, with one error naming what failed; only when neither
    can open does this raise."""
    try:
        return stream_cls(cfg.endpoint, cfg.record, **kw)
    except Exception as e:  # noqa: BLE001 - which output failed is decided below
        if cfg.endpoint is None or cfg.record is None:
            raise
        both_error = e
    try:
        stream = stream_cls(cfg.endpoint, None, **kw)
    except Exception as e:  # noqa: BLE001
        log.error("kvscope: cannot publish on %s (%s); recording only", cfg.endpoint, e)
        return stream_cls(None, cfg.record, **kw)
    # the publisher opens alone: the recording was what failed
    log.error("kvscope: cannot record to %s (%s); publishing only", cfg.record, both_error)
    return stream


def _producer(scheduler: Any, cfg: Config, running: Any, version: str) -> Producer:
    p = getattr(scheduler, "_kvscope", None)
    if p is None:
        p = Producer(scheduler, cfg, running, version)
        scheduler._kvscope = p
        _producers.append(p)
    return p


class Producer:
    """One engine core's stream: reads the page table at each step boundary, emits the
    difference as one batch (engine-core thread), answers snapshots from its mirror."""

    def __init__(self, scheduler: Any, cfg: Config, running: Any, version: str) -> None:
        from kvscope.engine.events.wire.stream import EventStream

        self.on = False
        self.running = running
        self.differ = PageTableDiffer()
        self.reader = IncrementalReader(running)
        self.touched = Touched()
        self.lock = threading.Lock()  # held while the mirror changes (snapshots read it)
        self.step_no = 0
        self.warned_unexplained = False
        self.stream = None
        try:
            self.pool = scheduler.kv_cache_manager.block_pool
            self.pool._kvscope_touched = self.touched  # the tracking wrappers note here
            vcfg = getattr(scheduler, "vllm_config", None)
            rank = int(getattr(getattr(vcfg, "parallel_config", None),
                               "data_parallel_rank", 0) or 0)
            cfg = cfg.for_rank(rank)
            self.stream = open_outputs(EventStream, cfg,
                                       header=_header(scheduler, version, rank),
                                       snapshot_fn=self._snapshot, engine_lock=self.lock,
                                       keys=cfg.keys)
            self.on = True
            atexit.register(self.close)  # a vLLM that exits without shutting down
            log.info("kvscope: publishing vLLM's page table%s%s",
                     f" on {self.stream.endpoint}" if self.stream.publisher else "",
                     f", recording to {cfg.record}" if self.stream.recorder else "")
        except Exception:  # noqa: BLE001
            log.exception("kvscope: could not start; the kvscope plugin stays off")

    def _snapshot(self) -> dict[str, Any]:
        return self.differ.canonical()

    def note_preemption(self, scheduler: Any, request: Any) -> None:
        """Before vLLM frees the victim's blocks: who needed them, what was free."""
        try:
            # noted even without a cause: the step boundary tells a request preempted and
            # re-admitted within the step from one that kept running by this entry
            self.differ.preempt_causes[request.request_id] = {}
            caller = sys._getframe(2)
            if caller.f_code.co_name == "reset_prefix_cache":  # reset_running_requests=True
                self.differ.preempt_causes[request.request_id] = {C.REASON: C.R_RESET}
                return
            needed_by = caller.f_locals.get("request")  # schedule()'s loop request
            cause = {C.POLICY: _policy(scheduler), C.REASON: C.R_ALLOCATE,
                     C.FREE_BLOCKS: self.pool.get_num_free_blocks()}
            rid = getattr(needed_by, "request_id", None)
            if isinstance(rid, str):  # may be the victim itself (the last one running)
                cause[C.NEEDED_BY] = rid
            self.differ.preempt_causes[request.request_id] = cause
        except Exception:  # noqa: BLE001 - a cause is optional
            pass

    def end_step(self, scheduler: Any, scheduled_tokens: int | None) -> None:
        if not self.on:
            return
        t0 = time.perf_counter()
        try:
            with self.lock:
                pt, dirty = self.reader.read(scheduler, self.touched)
                if pt.unexplained and not self.warned_unexplained:
                    self.warned_unexplained = True
                    log.warning("kvscope: %d block references of vLLM are held outside any "
                                "request table vLLM exposes; shown as %s", pt.unexplained,
                                "vllm:reserved")
                self.differ.step(pt, self.stream.sink, dirty)
                self.step_no += 1
                self.stream.end_step(self.step_no, self._stats(scheduler, scheduled_tokens,
                                                               time.perf_counter() - t0))
        except Exception:  # noqa: BLE001 - never break vLLM
            self.on = False
            log.exception("kvscope: the page-table reader failed; the kvscope plugin is "
                          "off for the rest of this run")
            self.close()

    def _stats(self, scheduler: Any, scheduled_tokens: int | None,
               cost_s: float) -> dict[str, Any]:
        d = self.differ
        return {
            "running": len(scheduler.running), "waiting": len(scheduler.waiting),
            "scheduled_tokens": scheduled_tokens, "preemptions": d.preemptions,
            "evictions": d.evictions, "hit_tokens": d.hit_tokens,
            "tiers": {"gpu": d.block_counts()},
        }

    def close(self) -> None:
        if getattr(self, "pool", None) is not None:
            self.pool.__dict__.pop("_kvscope_touched", None)  # the wrappers stop noting
        if self.stream is not None:
            self.stream.close()


def _policy(scheduler: Any) -> str:
    name = str(getattr(getattr(scheduler, "policy", None), "name", "fcfs")).lower()
    return ("lowest priority, latest arrival" if name == "priority"
            else "latest running request (FCFS)")


def _header(scheduler: Any, version: str, rank: int) -> dict[str, Any]:
    """The stream's header: names vLLM, its version, the model and the KV geometry."""
    vcfg = getattr(scheduler, "vllm_config", None)
    model = getattr(getattr(vcfg, "model_config", None), "model", None)
    kvm = scheduler.kv_cache_manager
    groups = [{"block_size": m.kv_cache_spec.block_size,
               "spec": type(m.kv_cache_spec).__name__}
              for m in kvm.coordinator.single_type_managers]
    return {
        "engine": {"name": "vllm", "version": version, "data_parallel_rank": rank,
                   "num_blocks": kvm.block_pool.num_gpu_blocks,
                   "block_size": groups[0]["block_size"] if groups else None,
                   "kv_cache_groups": groups, "null_block": 0,
                   "prefix_caching": bool(kvm.block_pool.enable_caching),
                   # vLLM 0.33+: each block hash also covers this many tokens after the
                   # block, so a full block stays unhashed until they exist
                   "hash_lookahead_tokens": int(getattr(kvm.block_pool,
                                                        "num_hash_lookahead_tokens", 0) or 0),
                   "plugin_checked_against": list(CHECKED),
                   "unseen": list(UNSEEN)},
        "model": str(model) if model is not None else None,
        "producer": "kvscope vLLM plugin (engine.events.vllm.plugin)",
    }
