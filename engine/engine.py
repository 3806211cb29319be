"""LLMEngine: requests in, tokens out, one engine step at a time.

A step flows one way: schedule (the scheduler makes every cache call: demotion, then
allocation, maybe preemption; its ``SchedulerOutput`` carries the block tables, slot
mappings and tensor orders) -> execute (the runner performs the orders, builds the batch
and runs the model) -> sample (the ``Sampler``; n > 1 children are forked first) ->
process (the scheduler appends the tokens and finishes sequences; request outputs) ->
close the step's event batch. Everything the cache does during a step is reported
through the cache manager's event sink; ``kv_state()`` returns the manager's own view of
the cache in ``KVState.canonical()`` form, so the two can be compared at any step.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Any

import numpy as np
import torch

from kvscope.engine.cache import CacheError, KVCacheManager
from kvscope.engine.config import EngineConfig
from kvscope.engine.device import resolve_device, resolve_dtype
from kvscope.engine.events.sink import NullSink
from kvscope.engine.events.stats import StepStats, TierStats
from kvscope.engine.features import check_model
from kvscope.engine.model import load_model
from kvscope.engine.outputs import RequestOutput
from kvscope.engine.request_state import RequestState
from kvscope.engine.runner import kv_budget, mixed_kv
from kvscope.engine.runner.model_runner import ModelRunner
from kvscope.engine.runner.page_format import check_supported
from kvscope.engine.sampler import SampleError, Sampler, SampleRow
from kvscope.engine.sampling_ops import prompt_logprobs
from kvscope.engine.sampling_params import RequestOutputKind, SamplingParams
from kvscope.engine.scheduler import SampledToken, Scheduler, SchedulerOutput
from kvscope.engine.sequence import Sequence
from kvscope.engine.structured import ConstraintError

log = logging.getLogger(__name__)

# An empty step waiting only for disk reads blocks until they are all done, at most this
# long (then steps, so arrived ones are filled and the prefetch wait bound is checked).
# It blocks rather than polls: a polling engine thread starves the readers of the GIL.
IDLE_DISK_WAIT_S = 0.02
DISK_PERSIST_S = 30.0  # a graceful stop writes cached blocks to the disk tier for this long
PROMPT_LOGITS_ROWS = 256  # prompt positions turned into logits at once (rows x vocab fp32)


def _holding_cache_lock(method):
    """Run an engine method that changes the cache while holding ``self._cache_lock``."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._cache_lock:
            return method(self, *args, **kwargs)
    return locked


class LLMEngine:
    def __init__(self, config: EngineConfig, *, loaded: tuple | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        check_supported(config.kv_cache_dtype, self.device)  # before any weight is loaded
        self.model, self.tokenizer, self.model_config = loaded or load_model(
            config.model, device=self.device, dtype=self.dtype, seed=config.seed,
            hf_config=config.hf_config)
        mc = self.model_config
        limit = mc.max_position_embeddings
        if config.max_model_len is not None and not 1 < config.max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [2, {limit}], got {config.max_model_len}")
        self.max_model_len = config.max_model_len or limit
        check_model(config, mc)  # what combines, now that the model is known (its fallbacks:
        # the hybrid cache's in kv_budget, CUDA graphs' in the runner)
        # the cache's layout, decided once (engine.cache.spec): the cache manager, the
        # runner and tensor parallelism each take it whole
        self.kv_spec = kv = kv_budget.build(config, self.model, mc, self.device, self.dtype,
                                            self.max_model_len)
        self.page_format, self.mixed = kv.page, kv.mixed
        num_blocks = kv.num_blocks
        # Held while the cache changes: the event stream's thread snapshots the cache (for
        # late joiners, keyframes) at once when it can take it and no events are pending.
        self._cache_lock = threading.RLock()
        self.events = self._open_events()
        # why the recording stopped early (set at close from the stream; None: it did not)
        self.recording_error: str | None = None
        self.cache = KVCacheManager(
            spec=kv,
            enable_prefix_caching=config.enable_prefix_caching and config.kv_layout == "paged",
            eviction_policy=config.eviction_policy,
            sink=self.events.sink if self.events else NullSink(),
            demotion=mixed_kv.demotion_policy(self.mixed, config.kv_hot_window)
            if self.mixed else None,
        )
        if self.events:  # snapshots and keyframes come from the cache, between steps
            self.events.snapshot_fn = self.cache.snapshot
        self.scheduler = Scheduler(config, self.cache, self.max_model_len)
        if config.tensor_parallel_size > 1:  # rank 0 of N (engine.distributed.tp)
            from kvscope.engine.distributed.tp import start_tensor_parallel

            self.runner = start_tensor_parallel(config, self.model, mc, kv, self.device)
        else:
            self.runner = ModelRunner(self.model, mc, kv, self.device,
                                      enforce_eager=config.enforce_eager,
                                      max_model_len=self.max_model_len,
                                      max_num_seqs=config.max_num_seqs)
        self.swapper = self.runner.swapper  # the cpu tier's tensors (its figures: the stats)
        self.disk_io = None  # the disk tier's files and threads (engine.runner.disk_io)
        if kv.num_disk_blocks:
            self._open_disk(kv.num_disk_blocks)
        self.sampler = Sampler()
        self.requests: dict[str, RequestState] = {}
        self.step_count = 0
        self._seeds = np.random.default_rng(config.seed)  # same draw order as LLM's reference
        self.stats = StepStats()
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%s, %s pages)", num_blocks,
                 config.block_size, num_blocks * config.block_size, config.kv_layout,
                 self.page_format.name)
        if self.events:
            self._close_step(0.0, None)  # the tier_init events become batch 0

    # ---------------------------------------------------------------- set-up
    def _open_disk(self, num_disk_blocks: int) -> None:
        """Open the disk tier's directory and serve the blocks a previous run left there
        that match this model and page format (the most recent that fit)."""
        from kvscope.engine.runner.disk_io import open_disk

        cfg = self.config
        self.disk_io = open_disk(cfg.disk_cache_dir, cfg.model, self.page_format.name,
                                 cfg.block_size, self.swapper.host_tensors)
        self.swapper.disk = self.disk_io
        found = self.disk_io.store.scan()
        n = self.cache.adopt_disk([(e.hash, e.parent, e.first, e.tokens) for e in found])
        if n < len(found):  # a smaller --disk-cache-size than the run that wrote them
            log.warning("disk KV tier: %d of the %d blocks found do not fit %d blocks; the "
                        "least recently written are deleted", len(found) - n, len(found),
                        num_disk_blocks)
        log.info("disk KV tier: %s, %d blocks; %d found from a previous run%s",
                 cfg.disk_cache_dir, num_disk_blocks, n,
                 f" (disabled: {self.disk_io.store.error})" if self.disk_io.store.disabled
                 else "")

    def _open_events(self):
        from kvscope.engine.events.wire.stream import open_stream

        cfg = self.config
        header = {"model": cfg.model, "config": {
            k: v for k, v in vars(cfg).items()
            if isinstance(v, (int, float, str, bool)) and k != "events_keys"}}  # a local path
        return open_stream(cfg.events_endpoint, cfg.record_path, cfg.kv_events_config, header,
                           self._cache_lock, keys=cfg.events_keys)

    # ------------------------------------------------------------- requests
    @_holding_cache_lock
    def add_request(self, request_id: str, prompt: str | dict | list[int],
                    params: SamplingParams | dict | None = None, *, priority: int = 0,
                    arrival_time: float | None = None) -> None:
        """Queue a request. Raises ValueError/TypeError (and changes nothing) when the
        request is malformed or can never fit."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params is None:
            params = SamplingParams()
        elif isinstance(params, dict):
            params = SamplingParams(**params)
        elif not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams or dict, got {type(params).__name__}")
        text, ids = self._tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is "
                             f"{self.max_model_len} (at least one token must be generated)")
        capacity = self.cache_capacity_tokens
        need = self.max_model_len if self.config.kv_layout == "contiguous" else len(ids) + 1
        if need > capacity:
            raise ValueError(f"request needs {need} KV slots but the whole cache holds "
                             f"{capacity}; raise num_gpu_blocks/kv_cache_memory_bytes")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        params.check_vocabulary(self.model_config.vocab_size)
        if params.prompt_logprobs is not None and self.config.tensor_parallel_size > 1:
            # the kept prompt rows' logits would need a vocab-parallel gather on every rank
            raise ValueError("prompt_logprobs (and echo with logprobs) is not supported "
                             "with tensor_parallel_size > 1")
        now = time.monotonic() if arrival_time is None else arrival_time
        seed = int(self._seeds.integers(2**62))
        req = RequestState(request_id, text, ids, params, now,
                           params.seed if params.seed is not None else seed)
        seq = self._new_seq(req, 0, priority)
        if params.prompt_logprobs is not None:
            # Prompt logprobs need every prompt position's logits: a prefix-cache hit would
            # skip computing them, so such a request does not look the cache up until they
            # are all computed (its blocks are still stored for others).
            req.prompt_logprobs = [None]
            seq.prefix_lookup = len(ids) == 1
        self.requests[request_id] = req
        self.scheduler.add(seq)

    def _new_seq(self, req: RequestState, index: int, priority: int) -> Sequence:
        return req.add_seq(index, priority, self.tokenizer, self._eos_ids, self.max_model_len)

    @property
    def _eos_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        return ids

    def _tokenize(self, prompt: Any) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of a str, a token-id list, or a dict holding
        "prompt_token_ids" (and optionally its "prompt" text) or only "prompt"."""
        text = None
        if isinstance(prompt, dict):
            text = prompt.get("prompt")
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif isinstance(text, str):
                prompt = text
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"text prompts need a tokenizer; {self.config.model} has none: "
                                 "give token ids ({'prompt_token_ids': [...]} or a list)")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                       for t in prompt):
                raise ValueError(f"prompt token ids must lie in [0, {vocab})")
            return text, list(prompt)
        raise TypeError(f"a prompt is a str, a list of token ids or a dict, "
                        f"got {type(prompt).__name__}")

    @_holding_cache_lock
    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self.scheduler.abort(req.seqs)
        if self.events:  # make the frees visible even when no step follows
            self.scheduler.flush_events()

    @property
    def num_prefill_computed_tokens(self) -> int:
        """Tokens computed as prefill so far, as engine.events.analysis.lifecycle counts."""
        return self.scheduler.num_prefill_computed_tokens

    @property
    def num_recomputed_tokens(self) -> int:
        """Prefill tokens computed again after a recompute preemption."""
        return self.scheduler.num_recomputed_tokens

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def cache_capacity_tokens(self) -> int:
        return self.runner.num_blocks * self.config.block_size

    def kv_state(self) -> dict[str, Any]:
        """The cache manager's own state, in KVState.canonical() form."""
        return self.cache.snapshot()

    # ------------------------------------------------------------------ step
    @_holding_cache_lock
    def step(self) -> list[RequestOutput]:
        """schedule -> execute -> sample -> process; the request outputs this step
        changed (finished ones, and every change of a CUMULATIVE request)."""
        t0 = time.perf_counter()
        if self.disk_io is not None:  # writes done and reads arrived since the last step
            self.cache.disk_results(*self.disk_io.results())
        out = self.scheduler.schedule()
        touched = {seq.request_id: self.requests[seq.request_id] for seq in out.truncated}
        plan = self._prompt_logprob_plan(out)
        logits, kept = self.runner.run(out, [row for rows in plan.values()
                                             for row, _ in rows] or None)
        if kept is not None:
            self._add_prompt_logprobs(plan, kept, touched)
        if logits is not None:
            self._process(out, logits, touched)
        if out.is_empty and self.disk_io is not None and self.scheduler.waiting_for_disk:
            self.disk_io.wait_reads(IDLE_DISK_WAIT_S)  # nothing to run until reads arrive
        self._close_step(time.perf_counter() - t0, out)
        return [self._output(req) for req in touched.values()
                if req.finished or req.params.output_kind == RequestOutputKind.CUMULATIVE]

    def _prompt_logprob_plan(self, out) -> dict[str, list[tuple[int, int]]]:
        """Per request wanting prompt logprobs: (flattened-batch row, prompt token index it
        predicts) for the prompt positions this step computes and that are still missing
        (a recompute after preemption does not redo them)."""
        plan: dict[str, list[tuple[int, int]]] = {}
        offset = 0
        for s in out.scheduled:
            req = self.requests.get(s.seq.request_id)
            if req is not None and req.prompt_logprobs is not None and s.seq.index == 0:
                # The logits at position p predict prompt token p + 1.
                lo = max(s.start, len(req.prompt_logprobs) - 1)
                hi = min(s.start + s.num_new_tokens, len(req.prompt_token_ids) - 1)
                if lo < hi:
                    plan[req.request_id] = [(offset + p - s.start, p + 1)
                                            for p in range(lo, hi)]
            offset += s.num_new_tokens
        return plan

    def _add_prompt_logprobs(self, plan: dict[str, list[tuple[int, int]]],
                             kept: torch.Tensor, touched: dict[str, RequestState]) -> None:
        first = 0  # kept holds the plan's rows in order
        for rid, rows in plan.items():
            req = self.requests[rid]
            try:
                for i in range(0, len(rows), PROMPT_LOGITS_ROWS):
                    part = rows[i:i + PROMPT_LOGITS_ROWS]
                    logits = self.runner.logits_of(kept[first + i:first + i + len(part)])
                    targets = [req.prompt_token_ids[t] for _, t in part]
                    req.prompt_logprobs.extend(prompt_logprobs(logits, targets,
                                                               req.params.prompt_logprobs))
            except Exception as e:  # noqa: BLE001 - this request's fault, not the engine's
                self._fail_request(req, e, touched)
                self.scheduler.abort(req.seqs)
            first += len(rows)
            if len(req.prompt_logprobs) == len(req.prompt_token_ids):
                req.seqs[0].prefix_lookup = True

    def _fail_request(self, req: RequestState, exc: Exception,
                      touched: dict[str, RequestState]) -> None:
        """One request broke inside the step: it fails alone (the caller aborts its
        sequences: their blocks are freed and the event stream shows seq_finish "abort");
        the step goes on."""
        if isinstance(exc, ConstraintError):  # the request's constraint: its fault, one line
            log.warning("request %s aborted: %s", req.request_id, exc)
            req.error_is_constraint = True
        else:
            log.error("request %s failed inside the step; aborting it alone", req.request_id,
                      exc_info=exc)
        req.error = f"{type(exc).__name__}: {exc}"
        touched[req.request_id] = req

    def _process(self, out: SchedulerOutput, logits: torch.Tensor,
                 touched: dict[str, RequestState]) -> None:
        """Sample the step's rows and hand the tokens to the scheduler, in row order (a
        failed request's sequences are aborted in its place in that order)."""
        now = time.monotonic()
        sampled: list[SampledToken] = []
        rows = self._sample_rows(out, now, touched, sampled)
        for result in self.sampler.sample(rows, logits):
            req = self.requests[result.seq.request_id]
            if isinstance(result, SampleError):
                self._fail_request(req, result.error, touched)
                sampled += [SampledToken(seq, None, "abort") for seq in req.seqs]
            else:
                touched[req.request_id] = req
                sampled.append(result)
        self.scheduler.update_from_output(out, sampled, now)

    def _sample_rows(self, out: SchedulerOutput, now: float,
                     touched: dict[str, RequestState],
                     sampled: list[SampledToken]) -> list[SampleRow]:
        """The step's rows that sample, in batch order; a request with n > 1 forks its
        children when its parent's prompt is done, before its first token lands, so they
        share every prompt block copy-on-write (and sample from the parent's row). A fork
        the pool cannot hold (a contiguous reservation per child) fails that request
        alone: its sequences go into ``sampled`` as aborts and it samples no row."""
        rows: list[SampleRow] = []
        r = -1  # the logits row: the runner returns one per scheduled sequence that samples
        for s in out.scheduled:
            if not s.samples:
                continue
            r += 1
            seq = s.seq
            req = self.requests[seq.request_id]
            if req.error is not None:
                continue
            mine = [self._row(req, seq, r)]
            if seq.index == 0 and req.params.n > 1 and len(req.seqs) == 1:
                try:
                    for i in range(1, req.params.n):
                        child = self._new_seq(req, i, seq.priority)
                        child.num_computed_tokens = s.start + s.num_new_tokens
                        child.ever_started, child.first_scheduled_time = True, now
                        child.num_cached_tokens = seq.num_cached_tokens
                        self.scheduler.add_forked(seq, child)
                        mine.append(self._row(req, child, r))
                except CacheError as e:
                    # the child the pool refused never entered the cache: nothing to free
                    child.status, child.finish_reason = "finished", "abort"
                    self._fail_request(req, e, touched)
                    sampled += [SampledToken(x, None, "abort") for x in req.seqs]
                    continue
            rows += mine
        return rows

    @staticmethod
    def _row(req: RequestState, seq: Sequence, row: int) -> SampleRow:
        return SampleRow(seq, row, req.completions[seq.seq_id], req.generators[seq.seq_id])

    def _output(self, req: RequestState) -> RequestOutput:
        if req.finished:
            self.requests.pop(req.request_id, None)
        return req.output()

    # ------------------------------------------------------------- events
    def _close_step(self, step_time: float, out: SchedulerOutput | None) -> None:
        self.step_count += 1
        m = self.scheduler.end_step()  # closes the cache's event batch
        swap: dict[str, Any] = {}  # the cpu tier's counters, reported when it exists
        if self.swapper is not None:
            swap = {**self.swapper.stats(), **{k: m[k] for k in (
                "swap_outs", "swap_ins", "swap_out_blocks", "swap_in_blocks",
                "offloaded_blocks", "host_hit_tokens", "swap_fallbacks")}}
        self.stats = StepStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            swapped=len(self.scheduler.swapped),
            scheduled_tokens=out.num_batched_tokens if out else 0,
            prefill_tokens=sum(s.num_new_tokens for s in out.scheduled
                               if s.num_new_tokens > 1) if out else 0,
            decode_tokens=sum(1 for s in out.scheduled if s.num_new_tokens == 1) if out else 0,
            preemptions=self.scheduler.num_preemptions,
            step_time_s=step_time,
            hit_tokens=m["prefix_hit_tokens"],
            query_tokens=m["prefix_query_tokens"],
            evictions=m["evictions"],
            cow_copies=m["cow_copies"],
            demoted_blocks=m["demoted_blocks"],
            used_tokens=m["used_tokens"],
            tiers={name: TierStats(**t) for name, t in m["tiers"].items()},
            prefill_computed_tokens=self.num_prefill_computed_tokens,
            recomputed_tokens=self.num_recomputed_tokens,
            **swap,
        )
        # context length (positions attended) of each token decoded this step: the
        # /metrics decode-time-by-context histogram reads it (not published in stats)
        self.decode_contexts = [s.seq.num_computed_tokens for s in out.scheduled
                                if s.num_new_tokens == 1] if out else []
        if self.events:
            self.events.end_step(self.step_count, self.stats.to_map())

    def _persist_disk(self, deadline: float) -> None:
        io = self.disk_io
        self.cache.disk_results(*io.results())
        if self.cache.persist_to_disk():
            io.persist_until = deadline
            self.swapper.execute(self.cache.take_swap_rounds())
            left = io.drain(deadline)
            self.cache.disk_results(*io.results())
            log.info("disk KV tier: %d blocks written at stop%s", io.stats.saved,
                     f", {left} left unwritten (drain time over)" if left else "")
        io.close()
        self.disk_io = None

    @_holding_cache_lock
    def close(self) -> None:
        """Publish what happened since the last step (e.g. an abort on an idle engine) as
        a final batch, then flush and close the event stream and recording. With a disk
        tier, cached blocks not on disk yet are written there first (for at most
        ``DISK_PERSIST_S``), so that a restart starts warm."""
        if self.disk_io is not None:
            self._persist_disk(time.monotonic() + DISK_PERSIST_S)
        if self.events:
            self._close_step(0.0, None)
            self.events.close()
            # the recording's fate outlives the stream: the daemon's last line reports it
            self.recording_error = self.events.recording_error
            self.events = None
        close_runner = getattr(self.runner, "close", None)  # tensor-parallel workers
        if close_runner is not None:
            close_runner()
