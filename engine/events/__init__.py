"""kvscope's event stream: schema, KVState mirror, sinks (and, as they land, the codec,
publisher, subscriber and recordings). Importable without torch."""

from engine.events.schema import PROTOCOL_VERSION, ProtocolError
from engine.events.sink import EventSink, ListSink, NullSink
from engine.events.state import KVState, SeqState, TierState

__all__ = [
    "PROTOCOL_VERSION", "ProtocolError", "EventSink", "ListSink", "NullSink",
    "KVState", "SeqState", "TierState",
]
