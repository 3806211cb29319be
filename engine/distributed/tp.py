"""Tensor-parallel ranks: rank 0 is the engine process (scheduler, cache manager, event
stream, sampling); ranks 1..N-1 are worker processes that hold their shard of the weights
and of the KV pages and run each step's forward in lockstep.

Per step rank 0 broadcasts one small command (the StepBatch's index tensors, or
copy-on-write orders) with ``broadcast_object_list``; every rank then runs the same
forward, whose all-reduces and all-gather pair up (engine/model/parallel.py). The block
tables are the same on every rank, so nothing else crosses.

Failure is loud, never a hang: rank 0 checks that every worker is alive before each
command and its collectives time out after ``RANK0_TIMEOUT_S``; a worker's death raises
in the engine step, which fails the engine (the daemon's /health then answers 500).
Workers wait for commands without a timeout (an idle engine sends none) and die with
their parent (PR_SET_PDEATHSIG) or when a collective fails.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvscope.engine.cache.spec import KVSpec
from kvscope.engine.model.parallel import ShardedLlama, check_divisible, local_config, shard_weights
from kvscope.engine.runner.model_runner import ModelRunner, StepBatch

RANK0_TIMEOUT_S = 120.0
WORKER_IDLE_TIMEOUT = datetime.timedelta(days=7)
OP_STEP, OP_COPY, OP_STOP = "step", "copy", "stop"


class TensorParallelError(RuntimeError):
    """A worker rank died or a collective failed: the engine cannot go on."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: broadcasts each command to the workers, then runs its own shard."""

    def __init__(self, model: ShardedLlama, procs: list[Any], **kw: Any) -> None:
        super().__init__(model, model.config, **kw)
        self.procs = procs
        self.world = model.world

    def _check_alive(self) -> None:
        for rank, p in enumerate(self.procs, start=1):
            if not p.is_alive():
                raise TensorParallelError(
                    f"tensor-parallel rank {rank} died (exit code {p.exitcode}); the engine "
                    "cannot continue")

    def _send(self, command: dict[str, Any]) -> None:
        self._check_alive()
        try:
            dist.broadcast_object_list([command], src=0)
        except RuntimeError as e:
            raise TensorParallelError(f"tensor-parallel broadcast failed: {e}") from e

    def execute_keeping(self, batch: StepBatch, rows: list[int] | None
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every rank runs the step (``ModelRunner.execute`` comes here too). Kept rows
        (prompt logprobs) are refused at ``add_request`` with TP > 1: their logits would
        need a vocab-parallel gather on every rank."""
        if rows:
            raise TensorParallelError("prompt logprobs are not supported with tensor "
                                      "parallelism")
        self._send({"op": OP_STEP, "batch": {k: v.cpu() for k, v in vars(batch).items()
                                             if v is not None}})  # None: no window group
        try:
            return super().execute_keeping(batch, None)
        except RuntimeError as e:  # a collective failed or timed out
            self._check_alive()
            raise TensorParallelError(f"tensor-parallel step failed: {e}") from e

    def copy_blocks(self, orders: list[tuple[int, int]]) -> None:
        if orders:
            self._send({"op": OP_COPY, "orders": list(orders)})
        super().copy_blocks(orders)

    def close(self) -> None:
        """Stop the workers and leave the process group (safe to call twice)."""
        if dist.is_initialized():
            try:
                if all(p.is_alive() for p in self.procs):
                    dist.broadcast_object_list([{"op": OP_STOP}], src=0)
            except RuntimeError:
                pass
            dist.destroy_process_group()
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def shard_spec(spec: KVSpec, model_config: Any, world: int) -> KVSpec:
    """Every rank's KVSpec: the same blocks, its pages over its shard of the KV heads."""
    local = local_config(model_config, world)
    return spec.replace(page=dataclasses.replace(spec.page, num_kv_heads=local.num_kv_heads))


def start_tensor_parallel(config: Any, model: Any, model_config: Any, spec: KVSpec,
                          device: torch.device) -> TensorParallelRunner:
    """Spawn ranks 1..N-1 with their shards (CPU tensors travel through shared memory),
    join the process group as rank 0 and return rank 0's runner. ``spec``: the engine's
    KV layout (engine.cache.spec), over the whole model's heads."""
    world = config.tensor_parallel_size
    check_divisible(model_config, world)
    # refused with their reasons by the features table (engine.features): one plain pool
    assert not (spec.num_cpu_blocks or spec.mixed or spec.hybrid or config.kv_layout != "paged")
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"tensor_parallel_size={world} needs {world} GPUs; "
                         f"{torch.cuda.device_count()} visible")
    if dist.is_initialized():
        raise ValueError("a tensor-parallel engine is already running in this process")
    init = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    threads = max(1, torch.get_num_threads() // world)
    runner_kw = dict(spec=shard_spec(spec, model_config, world))
    procs = []
    for rank in range(1, world):
        shard = {k: v for k, v in shard_weights(model, world, rank).items()}
        shard = _to_cpu(shard)
        p = ctx.Process(target=run_worker, name=f"kvscope-tp{rank}", daemon=True,
                        args=(rank, world, init, model_config, shard, str(device), runner_kw,
                              threads))
        p.start()
        procs.append(p)
    _join_group(procs, device, init, world)
    mine = ShardedLlama(model_config, shard_weights(model, world, 0), world, 0, device)
    return TensorParallelRunner(mine, procs, device=device, **runner_kw)


def _join_group(procs: list[Any], device: torch.device, init: str, world: int) -> None:
    """Rank 0 joins the group; a worker that dies meanwhile (a bad import, no memory) is
    an error at once, not after the rendezvous timeout."""
    import threading

    failure: list[BaseException] = []

    def join() -> None:
        try:
            dist.init_process_group(_backend(device), init_method=init, world_size=world,
                                    rank=0, timeout=datetime.timedelta(seconds=RANK0_TIMEOUT_S))
        except BaseException as e:  # noqa: BLE001 - reported below
            failure.append(e)

    t = threading.Thread(target=join, name="kvscope-tp-join", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.1)
        dead = [(rank, p.exitcode) for rank, p in enumerate(procs, start=1) if not p.is_alive()]
        if dead and t.is_alive():
            failure.append(TensorParallelError(
                f"tensor-parallel rank {dead[0][0]} exited during start-up (exit code "
                f"{dead[0][1]}); see its error above"))
            break
    if failure:
        for p in procs:
            p.kill()
        raise TensorParallelError(f"tensor-parallel start-up failed: {failure[0]}") \
            from failure[0]


def _to_cpu(shard: dict) -> dict:
    def cpu(t):  # noqa: ANN001, ANN202
        return None if t is None else t.cpu()

    out = {k: cpu(v) for k, v in shard.items() if k != "layers"}
    if shard["lm_head"] is shard["embed"]:
        out["lm_head"] = out["embed"]
    out["layers"] = [dataclasses.replace(lw, **{f.name: cpu(getattr(lw, f.name))
                                                for f in dataclasses.fields(lw)})
                     for lw in shard["layers"]]
    return out


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def run_worker(rank: int, world: int, init: str, model_config: Any, shard: dict,
               device_name: str, runner_kw: dict, threads: int) -> None:
    """A worker rank's whole life: join, build its shard and KV pages, obey rank 0."""
    _die_with_parent()
    torch.set_num_threads(threads)
    device = _rank_device(torch.device(device_name), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(_backend(device), init_method=init, world_size=world, rank=rank,
                            timeout=WORKER_IDLE_TIMEOUT)
    model = ShardedLlama(model_config, shard, world, rank, device)
    del shard
    runner = ModelRunner(model, local_config(model_config, world), device=device, **runner_kw)
    try:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            cmd = box[0]
            if cmd["op"] == OP_STOP:
                break
            if cmd["op"] == OP_COPY:
                runner.copy_blocks(cmd["orders"])
            elif cmd["op"] == OP_STEP:
                b = cmd["batch"]
                runner.execute(StepBatch(**{k: v.to(device) for k, v in b.items()}))
    except RuntimeError as e:  # rank 0 went away: nothing to serve
        print(f"kvscope tensor-parallel rank {rank}: stopping: {e}", file=sys.stderr)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os._exit(0)
