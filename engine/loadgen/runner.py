"""Drive a workload against an OpenAI-compatible server and time every request.

Each session runs its turns in order (turn k+1 after turn k's answer, which joins the
history); at most ``concurrency`` requests are in flight. Requests stream
(``stream_options.include_usage``) so time to first token is measured by the client.
No new turn starts after ``duration`` seconds or once ``max_requests`` have started;
requests already sent complete, or, with ``max_wait_s``, are cancelled that many seconds
after ``duration`` (the connection closes, so the server aborts them) and recorded as
cancelled.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvscope.engine.loadgen.workloads import Session


@dataclass
class RequestRecord:
    session: int
    turn: int
    tag: str
    start_s: float  # since the run started
    ok: bool = False
    error: str = ""
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    text: str = ""
    cancelled: bool = False  # cut off by max_wait_s (not a failure)

    @property
    def tpot_s(self) -> float | None:
        """Mean gap between output tokens after the first (as the server's histogram)."""
        if not self.ok or self.ttft_s is None or self.latency_s is None or \
                self.completion_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass
class RunState:
    started: int = 0
    in_flight: int = 0
    records: list[RequestRecord] = field(default_factory=list)


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any],
               rec: RequestRecord, t_run: float) -> None:
    t0 = time.perf_counter()
    rec.start_s = t0 - t_run
    text: list[str] = []
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                try:
                    rec.error = f"{resp.status_code}: {json.loads(raw)['error']['message']}"
                except (ValueError, KeyError, TypeError):
                    rec.error = f"{resp.status_code}: {raw[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec.error = chunk["error"].get("message", "error event")
                    return
                for choice in chunk.get("choices", []):
                    piece = choice.get("delta", {}).get("content") or ""
                    if rec.ttft_s is None and (piece or choice.get("finish_reason")):
                        rec.ttft_s = time.perf_counter() - t0
                    text.append(piece)
                    rec.finish_reason = choice.get("finish_reason") or rec.finish_reason
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = usage["prompt_tokens"]
                    rec.completion_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = details.get("cached_tokens") or 0
        rec.latency_s = time.perf_counter() - t0
        rec.text = "".join(text)
        rec.ok = rec.finish_reason is not None
        if not rec.ok:
            rec.error = "stream ended without a finish reason"
    except (httpx.HTTPError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    except asyncio.CancelledError:
        rec.cancelled, rec.error = True, "cancelled at the end of the run"
        raise


async def run_sessions(base_url: str, sessions: list[Session], *, concurrency: int,
                       duration: float, max_requests: int | None = None,
                       model: str | None = None, api_key: str | None = None,
                       timeout_s: float = 600.0, max_wait_s: float | None = None,
                       state: RunState | None = None,
                       on_done: Callable[[RequestRecord, RunState], None] | None = None
                       ) -> RunState:
    state = state if state is not None else RunState()
    sem = asyncio.Semaphore(concurrency)
    url = base_url.rstrip("/") + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 2,
                          max_keepalive_connections=concurrency + 2)
    t_run = time.perf_counter()

    def may_start() -> bool:
        return time.perf_counter() - t_run < duration and \
            (max_requests is None or state.started < max_requests)

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0),
                                 headers=headers, limits=limits) as client:

        async def session_task(i: int, s: Session) -> None:
            delay = s.start_s - (time.perf_counter() - t_run)
            if delay > 0:
                await asyncio.sleep(delay)
            messages: list[dict[str, str]] = []
            if s.system:
                messages.append({"role": "system", "content": s.system})
            for k, user in enumerate(s.turns):
                async with sem:
                    if not may_start():
                        return
                    state.started += 1
                    state.in_flight += 1
                    messages.append({"role": "user", "content": user})
                    body: dict[str, Any] = {
                        "messages": messages, "max_tokens": s.max_tokens, "stream": True,
                        "stream_options": {"include_usage": True}, "temperature": 0.0}
                    if model:
                        body["model"] = model
                    rec = RequestRecord(i, k, s.tag, 0.0)
                    try:
                        await _one(client, url, body, rec, t_run)
                    finally:
                        state.in_flight -= 1
                        state.records.append(rec)
                        if on_done:
                            on_done(rec, state)
                if not rec.ok:
                    return  # the conversation cannot go on without this answer
                messages.append({"role": "assistant", "content": rec.text})
                if s.think_s:
                    await asyncio.sleep(s.think_s)

        tasks = [asyncio.ensure_future(session_task(i, s)) for i, s in enumerate(sessions)]
        limit = None if max_wait_s is None else duration + max_wait_s
        _, pending = await asyncio.wait(tasks, timeout=limit)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return state
