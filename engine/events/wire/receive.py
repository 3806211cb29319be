"""Bounded receive: one whole ZeroMQ message, frame by frame, within a byte and a frame
limit (issue 49). Every consumer of a stream (the kvscope ``Subscriber``, hence
``kvscope inspect --connect``, ``kvscope record --connect`` and the router; the
vLLM-events reader) receives through ``recv_bounded``.

Why: libzmq's ``ZMQ_MAXMSGSIZE`` bounds each frame, not a message, and
``recv_multipart`` keeps every frame of a message however many there are. Here a
message's frames are read one at a time (``RCVMORE``); past ``max_bytes`` in all or
``max_frames`` frames, the rest of the message is received and dropped as it is read
(never kept), and ``MessageTooLarge`` says so. What this bounds: what a consumer keeps
of one message (at most ``max_bytes`` plus one frame, itself at most ``max_bytes`` with
``ZMQ_MAXMSGSIZE`` set on the socket).

What it cannot bound (a limit of libzmq 4.3): libzmq delivers a message atomically, so
it holds every frame of an incomplete message inside its own pipe, and none reaches
the application until the last one arrives. A publisher whose frames say "more
follows" forever grows libzmq's buffer, out of reach of any receive loop; see
docs/events.md ("Limits").
"""

from __future__ import annotations

import zmq

from kvscope.engine.events.schema import ProtocolError

# kvscope's own messages have 3 frames (PUB: topic, seq, payload) or 1 (DEALER replies);
# vLLM's 3, its replay replies 4. A few more leave room; thousands of empty frames do
# not make a consumer hold thousands of objects.
DEFAULT_MAX_FRAMES = 8


class MessageTooLarge(ProtocolError):
    """A message past a consumer's limit: its frames were received and dropped."""


def recv_bounded(sock: zmq.Socket, max_bytes: int, max_frames: int = DEFAULT_MAX_FRAMES,
                 flags: int = 0) -> list[bytes]:
    """One whole message from ``sock``: its frames, at most ``max_frames`` of them and
    ``max_bytes`` together.

    ``flags`` apply to the first frame (``zmq.NOBLOCK``: ``zmq.Again`` when none is
    waiting); the others are already there (a message arrives whole). Past a limit the
    remaining frames are read and dropped, and ``MessageTooLarge`` is raised naming
    the limit: the socket is then at the next message's start."""
    frames: list[bytes] = []
    total = count = 0
    over: str | None = None
    more = True
    while more:
        frame = sock.recv(flags if count == 0 else 0, copy=False)
        more = frame.more
        count += 1
        if over is not None:
            total += len(frame)
            continue  # dropped: released as soon as the next one is read
        total += len(frame)
        if count > max_frames:
            over = f"more than {max_frames} frames"
        elif total > max_bytes:
            over = f"more than {max_bytes} bytes in all its frames"
        if over is not None:
            frames.clear()
        else:
            frames.append(frame.bytes)
    if over is not None:
        raise MessageTooLarge(f"message of {count} frames and {total} bytes dropped: "
                              f"{over} (the limit of one message)")
    return frames
