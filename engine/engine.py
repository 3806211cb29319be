"""LLMEngine: requests in, tokens out, one engine step at a time.

A step is: schedule (cache manager allocates, maybe preempts) -> execute copy-on-write
orders -> build the batch and run the model -> sample -> update sequences (append tokens,
check stops, fork n>1 children) -> close the step's event batch. Everything the cache
does during a step is reported through the cache manager's event sink; ``kv_state()``
returns the manager's own view of the cache in ``KVState.canonical()`` form, so the two
can be compared at any step.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine import mixed_kv
from engine.cache import KVCacheManager
from engine.cache.page_format import check_supported, page_format
from engine.completion import CompletionState
from engine.config import EngineConfig
from engine.device import resolve_device, resolve_dtype
from engine.events.sink import NullSink
from engine.model import load_model
from engine.outputs import RequestMetrics, RequestOutput
from engine.request import Sequence
from engine.runner import ModelRunner
from engine.sampling import SamplingParams, make_generator, sample, top_logprobs
from engine.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seed: int  # base seed: params.seed, else drawn from the engine's seeded generator
    seqs: list[Sequence] = field(default_factory=list)  # index order once forked
    generators: dict[str, torch.Generator | None] = field(default_factory=dict)
    completions: dict[str, CompletionState] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.status == "finished" for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig, *, loaded: tuple | None = None) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        check_supported(config.kv_cache_dtype, self.device)  # before any weight is loaded
        self.model, self.tokenizer, self.model_config = loaded or load_model(
            config.model, device=self.device, dtype=self.dtype)
        mc = self.model_config
        limit = mc.max_position_embeddings
        if config.max_model_len is not None and not 1 < config.max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [2, {limit}], got {config.max_model_len}")
        self.max_model_len = config.max_model_len or limit
        self.page_format = page_format(config.kv_cache_dtype, self.dtype, mc, config.block_size)
        # --kv-demotion: an arena of frames (engine.mixed_kv); num_blocks then counts frames
        self.mixed = mixed_kv.mixed_layout(config.kv_demotion, self.dtype, mc, config.block_size)
        num_blocks = self._num_kv_blocks()
        num_cpu_blocks = self._num_cpu_blocks()
        self.events = self._open_events()
        self.cache = KVCacheManager(
            num_blocks, config.block_size, num_cpu_blocks=num_cpu_blocks,
            enable_prefix_caching=config.enable_prefix_caching and config.kv_layout == "paged",
            eviction_policy=config.eviction_policy, kv_format=self.page_format.name,
            sink=self.events.sink if self.events else NullSink(),
            demotion=mixed_kv.demotion_policy(self.mixed, config.kv_hot_window)
            if self.mixed else None,
        )
        if self.events:
            # Re-seeds the stream's mirror if it ever drops a batch (called at a step boundary).
            from engine.events.state import KVState

            self.events.snapshot_fn = lambda: KVState.from_canonical(
                self.cache.snapshot()).snapshot()
        self.scheduler = Scheduler(config, self.cache, self.max_model_len)
        self.runner = ModelRunner(self.model, mc, num_blocks, config.block_size, self.device,
                                  self.dtype, kv_cache_dtype=config.kv_cache_dtype,
                                  mixed=self.mixed)
        self.swapper = None  # the cpu tier's tensors (engine.swapper)
        if num_cpu_blocks:
            from engine.swapper import Swapper

            self.swapper = Swapper(self.runner.kv.per_block_tensors, num_cpu_blocks)
        self.requests: dict[str, _Request] = {}
        self.step_count = 0
        self._seeds = np.random.default_rng(config.seed)  # same draw order as LLM's reference
        self.stats: dict[str, Any] = {}
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%s, %s pages)", num_blocks,
                 config.block_size, num_blocks * config.block_size, config.kv_layout,
                 self.page_format.name)
        if self.events:
            self._close_step(0.0, None)  # the tier_init events become batch 0

    # ---------------------------------------------------------------- set-up
    def _num_kv_blocks(self) -> int:
        cfg = self.config
        per_block = self.page_format.bytes_per_block  # scales included
        if self.mixed is not None:
            per_block = mixed_kv.bytes_per_frame(self.mixed, self.model_config.num_layers)
        if cfg.num_gpu_blocks is not None:
            return cfg.num_gpu_blocks
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._profile_cuda_budget()
        else:
            from engine.config import DEFAULT_CPU_KV_BYTES
            budget = DEFAULT_CPU_KV_BYTES
        blocks = budget // per_block
        if blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes holds no block of "
                             f"{per_block} bytes; raise it")
        return int(blocks)

    def _num_cpu_blocks(self) -> int:
        """Blocks of the cpu tier: ``swap_space`` GiB of pages of the device's format."""
        cfg = self.config
        blocks = int(cfg.swap_space * (1 << 30)) // self.page_format.bytes_per_block
        if cfg.preemption_mode == "swap" and blocks < 1:
            raise ValueError(f"preemption_mode='swap' needs swap_space > 0 GiB holding at "
                             f"least one block of {self.page_format.bytes_per_block} bytes")
        return blocks

    @torch.inference_mode()
    def _profile_cuda_budget(self) -> int:
        """Free memory after a forward of max_num_batched_tokens, times the utilisation."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = self.config.max_num_batched_tokens
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        pos = torch.arange(n, device=self.device)
        from kernels.contiguous import contiguous_attention

        scale = self.model_config.head_dim ** -0.5

        def attn(layer, q, k, v):
            return contiguous_attention(q, k, v, 0, scale)

        self.model.compute_logits(self.model.forward(ids, pos, attn)[-1:])
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        used_other = total - free - torch.cuda.memory_allocated(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        return int(total * self.config.gpu_memory_utilization - peak - used_other)

    def _open_events(self):
        cfg = self.config
        if not (cfg.events_endpoint or cfg.record_path):
            return None
        from engine.events.stream import EventStream

        header = {"model": cfg.model, "config": {k: v for k, v in vars(cfg).items()
                                                  if isinstance(v, (int, float, str, bool))}}
        return EventStream(endpoint=cfg.events_endpoint, record_path=cfg.record_path,
                           header=header)

    # ------------------------------------------------------------- requests
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
        now = time.monotonic() if arrival_time is None else arrival_time
        seed = int(self._seeds.integers(2**62))
        req = _Request(request_id, text, ids, params, now,
                       params.seed if params.seed is not None else seed)
        seq = self._new_seq(req, 0, priority)
        self.requests[request_id] = req
        self.scheduler.add(seq)

    def _new_seq(self, req: _Request, index: int, priority: int) -> Sequence:
        sid = req.request_id if index == 0 else f"{req.request_id}#{index}"
        seq = Sequence(sid, req.request_id, index, list(req.prompt_token_ids), req.params,
                       priority=priority, arrival_time=req.arrival_time)
        budget = min(req.params.max_tokens, self.max_model_len - len(req.prompt_token_ids))
        state = CompletionState(index, req.params, self.tokenizer, req.prompt_token_ids,
                                self._eos_ids, budget)
        seq.output_token_ids = state.output.token_ids  # one list, two views
        req.seqs.append(seq)
        req.completions[sid] = state
        req.generators[sid] = (None if req.params.greedy
                               else make_generator(req.seed, index, "cpu"))
        return seq

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
                raise ValueError("text prompts need a tokenizer; this model has none")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)):
            vocab = self.model_config.vocab_size
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                       for t in prompt):
                raise ValueError(f"prompt token ids must lie in [0, {vocab})")
            return text, list(prompt)
        raise TypeError(f"a prompt is a str, a list of token ids or a dict, "
                        f"got {type(prompt).__name__}")

    def abort_request(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if seq.status != "finished":
                self.scheduler.finish(seq, "abort")
        if self.events:  # make the frees visible even when no step follows
            self.cache.flush_step_events()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def cache_capacity_tokens(self) -> int:
        return self.runner.num_blocks * self.config.block_size

    def kv_state(self) -> dict[str, Any]:
        """The cache manager's own state, in KVState.canonical() form."""
        return self.cache.snapshot()

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self.mixed is not None:  # make room for the next admission by demoting first
            self.cache.demote_cold_blocks(mixed_kv.admission_need(self.scheduler))
        out = self.scheduler.schedule()
        if self.mixed is not None:  # before copy-on-write and the forward pass
            self.runner.demote(self.cache.take_demotion_orders())
        if self.swapper is not None:  # before copy-on-write (cache.take_swap_rounds)
            self.swapper.execute(self.cache.take_swap_rounds())
        touched: dict[str, _Request] = {}
        for seq in out.truncated:
            touched[seq.request_id] = self.requests[seq.request_id]
        if not out.is_empty:
            orders = self.cache.take_copy_orders()
            tables = [self.cache.block_table(s.seq.seq_id) for s in out.scheduled]
            if self.mixed is not None:  # the kernels read page codes
                codes = self.cache.page_codes
                orders = [(codes([a])[0], codes([b])[0]) for a, b in orders]
                tables = [codes(t) for t in tables]
            self.runner.copy_blocks(orders)
            batch = self.runner.prepare(out.scheduled, tables)
            logits = self.runner.execute(batch)
            self._process(out, logits, touched)
        self._close_step(time.perf_counter() - t0, out)
        return [self._output(req) for req in touched.values()]

    def _process(self, out, logits: torch.Tensor, touched: dict[str, _Request]) -> None:
        now = time.monotonic()
        rows: list[tuple[Sequence, int]] = []  # (sequence, logits row) that sample
        r = 0
        for s in out.scheduled:
            seq = s.seq
            sampling = s.samples
            seq.num_computed_tokens += s.num_new_tokens
            if not sampling:
                continue
            req = self.requests[seq.request_id]
            rows.append((seq, r))
            # n > 1: fork the children when the parent's prompt is done, before its first
            # token lands, so they share every prompt block copy-on-write.
            if seq.index == 0 and req.params.n > 1 and len(req.seqs) == 1:
                for i in range(1, req.params.n):
                    child = self._new_seq(req, i, seq.priority)
                    child.num_computed_tokens = seq.num_computed_tokens
                    child.ever_started, child.first_scheduled_time = True, now
                    child.num_cached_tokens = seq.num_cached_tokens
                    self.scheduler.add_forked(seq, child)
                    rows.append((child, r))
            r += 1
        if not rows:
            return
        idx = torch.tensor([row for _, row in rows], dtype=torch.int64)
        rows_logits = logits[idx]
        params = [seq.params for seq, _ in rows]
        tokens, logprobs = sample(
            rows_logits, params,
            [self.requests[seq.request_id].generators[seq.seq_id] for seq, _ in rows])
        tops = top_logprobs(rows_logits, params, tokens)
        for (seq, _), tok, lp, top in zip(rows, tokens.tolist(), logprobs.tolist(), tops,
                                          strict=True):
            req = self.requests[seq.request_id]
            touched[req.request_id] = req
            if seq.first_token_time is None:
                seq.first_token_time = now
            done = req.completions[seq.seq_id].add(tok, lp, top)
            self.cache.append_token_ids(seq.seq_id, [tok])
            if done:
                self.scheduler.finish(seq, req.completions[seq.seq_id].output.finish_reason)

    def _output(self, req: _Request) -> RequestOutput:
        outs = [copy.copy(req.completions[s.seq_id].output) for s in req.seqs]
        for o in outs:
            o.token_ids = list(o.token_ids)
        finished = req.finished
        if finished:
            self.requests.pop(req.request_id, None)
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids, outputs=outs, finished=finished,
            metrics=self._metrics(req),
        )

    def _metrics(self, req: _Request) -> RequestMetrics:
        firsts = [s.first_token_time for s in req.seqs if s.first_token_time is not None]
        done = [s.finished_time for s in req.seqs if s.finished_time is not None]
        return RequestMetrics(
            arrival_time=req.arrival_time,
            first_token_time=min(firsts) if firsts else None,
            finished_time=max(done) if req.finished and done else None,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_generation_tokens=sum(len(s.output_token_ids) for s in req.seqs),
            num_cached_tokens=req.seqs[0].num_cached_tokens,
            num_preemptions=sum(s.num_preemptions for s in req.seqs),
        )

    # ------------------------------------------------------------- events
    def _close_step(self, step_time: float, out) -> None:
        self.step_count += 1
        m = self.cache.metrics()
        self.stats = {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "swapped": len(self.scheduler.swapped),
            "scheduled_tokens": out.num_batched_tokens if out else 0,
            "prefill_tokens": sum(s.num_new_tokens for s in out.scheduled
                                  if s.num_new_tokens > 1) if out else 0,
            "decode_tokens": sum(1 for s in out.scheduled if s.num_new_tokens == 1) if out else 0,
            "preemptions": self.scheduler.num_preemptions,
            "step_time_s": step_time,
            "hit_tokens": m["prefix_hit_tokens"],
            "query_tokens": m["prefix_query_tokens"],
            "evictions": m["evictions"],
            "cow_copies": m["cow_copies"],
            "demoted_blocks": m["demoted_blocks"],
            "used_tokens": m["used_tokens"],
            "tiers": m["tiers"],
        }
        if self.swapper is not None:
            self.stats.update(self.swapper.stats())
            self.stats.update({k: m[k] for k in (
                "swap_outs", "swap_ins", "swap_out_blocks", "swap_in_blocks",
                "offloaded_blocks", "host_hit_tokens", "swap_fallbacks")})
        self.cache.flush_step_events()
        if self.events:
            self.events.end_step(self.step_count, self.stats)

    def close(self) -> None:
        """Publish what happened since the last step (e.g. an abort on an idle engine) as
        a final batch, then flush and close the event stream and recording."""
        if self.events:
            self._close_step(0.0, None)
            self.events.close()
            self.events = None
