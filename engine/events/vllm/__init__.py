"""vLLM inside kvscope and kvscope inside vLLM (torch-free).

vLLM's own KV-event contract (hash-keyed events), both ways, in the ``kv_events_*`` files:

- ``kv_events_wire``: the msgpack layout of vLLM 0.32/0.33's EventBatch / BlockStored /
  BlockRemoved / AllBlocksCleared, encoded and decoded by hand.
- ``translate``: kvscope's per-step event batches -> vLLM events (the one place).
- ``kv_events_publisher``: ``VllmPublisher``, an EventStream consumer speaking vLLM's ZeroMQ
  PUB + replay ROUTER (``kvscope serve --kv-events-config``).
- ``kv_events_subscriber``: ``VllmSubscriber``, reads any vLLM-format publisher (connects
  or binds).
- ``prefix_cache``: ``VllmPrefixCache``, the per-medium index such a stream describes.
- ``kv_events_recording``: raw-message recordings (``.vllmtrace``) of such a stream.

The plugin that publishes vLLM's whole page table in kvscope's own protocol:
``plugin`` (the entry point), ``pagetable`` (vLLM's state read at a step boundary),
``tracker`` (kept current from what a step touched).
"""

from kvscope.engine.events.vllm.config import KVEventsConfig
from kvscope.engine.events.vllm.kv_events_subscriber import VllmBatch, VllmSubscriber
from kvscope.engine.events.vllm.kv_events_wire import VllmWireError
from kvscope.engine.events.vllm.prefix_cache import NOT_PUBLISHED, VllmPrefixCache
from kvscope.engine.events.vllm.translate import VllmTranslator

__all__ = ["KVEventsConfig", "NOT_PUBLISHED", "VllmBatch", "VllmPrefixCache",
           "VllmSubscriber", "VllmTranslator", "VllmWireError"]
