"""kvscope's event stream: schema, KVState mirror, sinks, codec, the engine-side
EventStream (publisher + recorder), the Subscriber and recordings. Importable without
torch (numpy, msgpack, pyzmq and zstandard only)."""

from engine.events.codec import Codec
from engine.events.recording import Recording, RecordingError, RecordingWarning, RecordingWriter
from engine.events.schema import PROTOCOL_VERSION, ProtocolError
from engine.events.sink import EventSink, ListSink, NullSink
from engine.events.state import KVState, SeqState, TierState
from engine.events.stream import BatchConsumer, EventStream
from engine.events.subscriber import Subscriber

__all__ = [
    "PROTOCOL_VERSION", "ProtocolError", "EventSink", "ListSink", "NullSink",
    "KVState", "SeqState", "TierState", "Codec", "EventStream", "BatchConsumer", "Subscriber",
    "Recording", "RecordingWriter", "RecordingError", "RecordingWarning",
]
