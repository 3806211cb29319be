"""``--kv-events-config``: vLLM's ``KVEventsConfig`` JSON, same keys and defaults.

    {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557",
     "replay_endpoint": "tcp://*:5558", "topic": "kv@model", "buffer_steps": 10000,
     "hwm": 100000, "max_queue_size": 100000}

As in vLLM, ``publisher`` defaults to "zmq" when events are enabled and "null" otherwise,
and an unknown key is an error (vLLM's config is a strict dataclass).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            object.__setattr__(self, "publisher",
                               "zmq" if self.enable_kv_cache_events else "null")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv-events-config: unknown publisher {self.publisher!r} "
                             "(kvscope, as vLLM, has 'zmq' and 'null')")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"kv-events-config: {name} must be an int >= 1, "
                                 f"got {value!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv-events-config: {name} must be a string")
        if self.replay_endpoint is not None and not isinstance(self.replay_endpoint, str):
            raise ValueError("kv-events-config: replay_endpoint must be a string or null")

    @property
    def enabled(self) -> bool:
        return bool(self.enable_kv_cache_events) and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the flag's JSON. Raises ValueError with the reason."""
        try:
            data: Any = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv-events-config is not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"kv-events-config: unknown key(s) {unknown}; "
                             f"known: {sorted(known)}")
        return cls(**data)
