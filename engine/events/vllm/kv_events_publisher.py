"""VllmPublisher: kvscope's cache events on vLLM's KV-event contract (ZeroMQ PUB + ROUTER).

An EventStream consumer: ``on_batch(batch)`` is called on the stream's thread once per
closed kvscope batch and only queues it; this publisher's own thread translates
(``VllmTranslator``), encodes (``wire.Encoder``), sends ``[topic, seq, payload]`` and
answers replay requests, like vLLM's ``ZmqEventPublisher``:

- seq counts published batches from 0; a step whose batch holds no vLLM event publishes
  nothing (vLLM publishes only non-empty batches);
- the PUB socket BINDS for wildcard (``*``, ``::``) and ipc/inproc endpoints and CONNECTS
  to any other (``tcp://127.0.0.1:5557`` means "a consumer listens there"); one
  difference: ``tcp://*:0`` binds loopback on a free port (vLLM binds the node's IP);
- the replay ROUTER (``replay_endpoint``, always bound) streams every buffered batch
  (the last ``buffer_steps``) with ``seq >= start`` and ends with seq -1;
- ``hwm`` is the PUB high-water mark, ``max_queue_size`` bounds the queue between the
  stream thread and this one (a full queue drops the batch, counted in ``dropped``; the
  translator then answers the gap with AllBlocksCleared).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import threading
import time
from typing import Any

import zmq

from kvscope.engine.events.columns import StepColumns
from kvscope.engine.events.vllm import kv_events_wire as W
from kvscope.engine.events.vllm.config import KVEventsConfig
from kvscope.engine.events.vllm.translate import VllmTranslator

log = logging.getLogger(__name__)


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: bind wildcard and ipc/inproc endpoints, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    if endpoint == "tcp://*:0":
        endpoint = "tcp://127.0.0.1:*"
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise OSError(f"cannot bind vLLM event endpoint {endpoint}: {e}") from e
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class VllmPublisher:
    """Publishes vLLM-format KV events for one engine (data parallel rank 0)."""

    needs_store_detail = True  # asks the EventStream's sink for parents/tokens on stores

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self.translator = VllmTranslator()
        self.seq = -1  # last published
        self.dropped = 0
        self.replays_served = 0
        self.errors = 0
        self.batches_in = 0  # kvscope batches queued (written by the stream thread)
        self.batches_done = 0  # ... and translated (written by this thread)
        self._topic = config.topic.encode("utf-8")
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_steps)
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            if is_bind_endpoint(config.endpoint):
                self.endpoint = _bind(self._pub, config.endpoint)
            else:
                self._pub.connect(config.endpoint)
                self.endpoint = config.endpoint
            self.replay_endpoint = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(self._replay, config.replay_endpoint)
        except BaseException:
            self._close_sockets()
            raise
        self._encoder = W.Encoder()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvscope-vllm-events",
                                        daemon=True)
        self._thread.start()

    # ---------------------------------------------------- the stream's thread
    def on_batch(self, batch: dict[str, Any]) -> None:
        """Queue one kvscope batch (never blocks)."""
        # The stream packs id lists in place once its consumers return (protocol 2), and
        # this batch is translated later on our own thread: keep a shallow copy of each
        # event, whose lists the packing replaces but never mutates. A bulk step in
        # columns is translated from them (their arrays are never packed): copy only the
        # maps the columns do not hold.
        cols = batch.get("columns")
        if isinstance(cols, StepColumns):
            cols = dataclasses.replace(cols, others=[dict(ev) for ev in cols.others],
                                       source=None)
            batch = {**batch, "events": [], "columns": cols}
        else:
            batch = {**batch, "events": [dict(ev) for ev in batch["events"]]}
        try:
            self._queue.put_nowait(batch)
            self.batches_in += 1
        except queue.Full:
            self.dropped += 1

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until every queued batch is published (tests). False on timeout."""
        end = time.monotonic() + timeout
        while self.batches_done < self.batches_in:
            if time.monotonic() > end or not self._thread.is_alive():
                return False
            time.sleep(0.001)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Publish what is queued, then close the sockets."""
        self._stop.set()
        self._thread.join(timeout)

    # ------------------------------------------------------- own thread
    def _run(self) -> None:
        try:
            while True:
                try:
                    batch = self._queue.get(timeout=0.02)
                except queue.Empty:
                    batch = None
                    if self._stop.is_set():
                        break
                if batch is not None:
                    self._publish(batch)
                    self.batches_done += 1
                self._serve_replay()
        except Exception:
            log.exception("vLLM event publisher failed; vLLM-format events stop")
        finally:
            self._close_sockets()

    def _publish(self, batch: dict[str, Any]) -> None:
        try:
            events = self.translator.translate(batch)
        except (KeyError, TypeError, ValueError) as e:  # an engine bug: say so, go on
            self.errors += 1
            log.error("cannot translate kvscope batch %s to vLLM events: %s",
                      batch.get("seq"), e)
            return
        if not events:
            return
        payload = self._encoder.encode(batch["time"], events, self.data_parallel_rank)
        self.seq += 1
        try:
            self._pub.send_multipart((self._topic, W.encode_seq(self.seq), payload),
                                     flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1  # past the HWM: subscribers see the gap and may replay
        self._buffer.append((self.seq, payload))

    def _serve_replay(self) -> None:
        sock = self._replay
        while sock is not None and sock.poll(0):
            frames = sock.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != W.SEQ_BYTES:
                log.warning("ignoring a malformed vLLM replay request (%d frames)",
                            len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in self._buffer:
                if seq >= start:
                    sock.send_multipart((client, b"", self._topic, W.encode_seq(seq),
                                         payload))
            sock.send_multipart((client, b"", b"", W.encode_seq(W.END_SEQ), b""))
            self.replays_served += 1

    def _close_sockets(self) -> None:
        self._pub.close(linger=500)  # let the last batches out (vLLM drops them: linger 0)
        if self._replay is not None:
            self._replay.close(linger=0)
