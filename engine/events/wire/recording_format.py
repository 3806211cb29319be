"""The .kvtrace file's byte layout (recording.py's docstring describes it) and its
errors: what the writer writes and the reader checks. Torch-free."""

from __future__ import annotations

import struct

from kvscope.engine.events.schema import ProtocolError

MAGIC = b"KVSTRACE"
TRAILER_MAGIC = b"KVSINDEX"
FORMAT_VERSION = 1
_FILE_HEAD = struct.Struct(">8sII")
_FRAME_HEAD = struct.Struct(">cIII")
_TRAILER = struct.Struct(">8sQ")
KEYFRAME, DELTAS, INDEX = b"K", b"D", b"I"


class RecordingError(ProtocolError):
    """A file that is not a readable kvscope recording (the message names the file)."""


class RecordingWarning(UserWarning):
    """A recording that was not closed cleanly (read up to its last complete frame)."""
