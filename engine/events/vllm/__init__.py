"""vLLM's KV-event contract, both ways (torch-free).

- ``wire``: the msgpack layout of vLLM 0.32/0.33's EventBatch / BlockStored /
  BlockRemoved / AllBlocksCleared, encoded and decoded by hand.
- ``translate``: kvscope's per-step event batches -> vLLM events (the one place).
- ``publisher``: ``VllmPublisher``, an EventStream consumer speaking vLLM's ZeroMQ
  PUB + replay ROUTER (``kvscope serve --kv-events-config``).
- ``subscriber``: ``VllmSubscriber``, reads any vLLM-format publisher (connects or binds).
- ``prefix_cache``: ``VllmPrefixCache``, the per-medium index such a stream describes.
- ``recording``: raw-message recordings (``.vllmtrace``) of such a stream.
"""

from kvscope.engine.events.vllm.config import KVEventsConfig
from kvscope.engine.events.vllm.prefix_cache import NOT_PUBLISHED, VllmPrefixCache
from kvscope.engine.events.vllm.subscriber import VllmBatch, VllmSubscriber
from kvscope.engine.events.vllm.translate import VllmTranslator
from kvscope.engine.events.vllm.wire import VllmWireError

__all__ = ["KVEventsConfig", "NOT_PUBLISHED", "VllmBatch", "VllmPrefixCache",
           "VllmSubscriber", "VllmTranslator", "VllmWireError"]
