"""What every handler of the daemon shares: its settings (from the command line) and its
state (the engine it talks to, the metrics, the model's tokenizer and limits)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvscope.engine.server.delivery import StepDelivery
from kvscope.engine.server.engine_client import EngineClient
from kvscope.engine.server.limits import Limits
from kvscope.engine.server.metrics import ServerMetrics


@dataclass
class ServerSettings:
    served_model_name: str = "smollm2"
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    max_body_bytes: int = 4 << 20
    max_n: int = 16  # completions per request (n times the number of prompts)
    max_logprobs: int = 20  # logprobs / top_logprobs / prompt_logprobs (vLLM's default)
    drain_timeout_s: float = 30.0
    metrics_prefix: str = "kvscope"  # or "vllm": vLLM's metric names (server/metrics.py)
    # tool_choice "auto": the parser of the model family's tool-call syntax (tool_parsers;
    # vLLM's --enable-auto-tool-choice --tool-call-parser NAME); None refuses "auto"
    tool_parser: str | None = None
    chat_template: str | None = None  # --chat-template: replaces the model's own


@dataclass
class ServerState:
    engine: EngineClient
    metrics: ServerMetrics
    settings: ServerSettings
    tokenizer: Any  # the model's (engine.model.tokenizer.Tokenizer); None for a dummy model
    max_model_len: int
    vocab_size: int
    draining: bool = False
    answering: int = 0  # HTTP requests whose answer is not sent yet (app.py counts them)
    created: int = field(default_factory=lambda: int(time.time()))
    delivery: StepDelivery | None = None  # of the running event loop, made on first use

    @property
    def limits(self) -> Limits:
        s = self.settings
        return Limits(self.max_model_len, self.vocab_size, s.max_n, s.max_logprobs)
