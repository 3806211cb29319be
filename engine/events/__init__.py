"""kvscope's event protocol and its mirror: the schema (each event kind as a type: what it
carries and means), the step statistics (``stats.StepStats``), the sinks the cache reports
to, the causes of preemptions and evictions, and ``KVState``, whose ``apply`` is the one
meaning of every event. Importable without torch; ``python -m engine.events`` prints the
kinds and the stats as tables.

The rest of the event stream lives in subpackages: ``engine.events.wire`` (codec,
publisher, the engine-side EventStream, subscriber, recordings), ``engine.events.analysis``
(lifecycles, costs, ranges, trace export) and ``engine.events.vllm`` (vLLM's KV-event
format, both ways)."""

from kvscope.engine.events.schema import PROTOCOL_VERSION, ProtocolError
from kvscope.engine.events.sink import EventSink, ListSink, NullSink
from kvscope.engine.events.state import KVState, SeqState, TierState

__all__ = [
    "PROTOCOL_VERSION", "ProtocolError", "EventSink", "ListSink", "NullSink",
    "KVState", "SeqState", "TierState",
]
