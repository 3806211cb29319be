"""The event stream on the wire: the codec (msgpack messages, ZeroMQ frames), the
publisher, the engine-side ``EventStream`` (publisher + recorder), the ``Subscriber`` and
recordings. Torch-free."""

from kvscope.engine.events.wire.codec import Codec
from kvscope.engine.events.wire.recording import (
    Recording,
    RecordingError,
    RecordingWarning,
    RecordingWriter,
)
from kvscope.engine.events.wire.stream import BatchConsumer, EventStream
from kvscope.engine.events.wire.subscriber import Subscriber

__all__ = ["Codec", "EventStream", "BatchConsumer", "Subscriber", "Recording",
           "RecordingWriter", "RecordingError", "RecordingWarning"]
