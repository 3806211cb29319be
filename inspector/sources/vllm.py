"""Sources for a vLLM-format KV-event stream (vLLM, SGLang, a kvscope engine run with
``--kv-events-config``): live (``VllmLiveSource``) or a ``.vllmtrace`` recording
(``load_vllm_recording``). Both feed a ``VllmPrefixCache`` (engine.events.vllm), which is
all such a stream can describe: the prefix-cache index per medium.

Threads (as LiveSource): a receiver thread owns the VllmSubscriber and queues decoded
batches (bounded); ``drain()``, called by a QTimer on the GUI thread, applies what is
queued. A restart (seq going back) clears the cache before the new publisher's batches.
"""

from __future__ import annotations

import threading
from collections import deque
from pathlib import Path
from typing import Any

from kvscope.engine.events.vllm.kv_events_recording import VllmRecordingWriter, read_batches
from kvscope.engine.events.vllm.kv_events_subscriber import VllmBatch, VllmSubscriber
from kvscope.engine.events.vllm.kv_events_wire import VllmWireError
from kvscope.engine.events.vllm.prefix_cache import IndexFull, VllmPrefixCache
from kvscope.inspector.errors import InspectError

MAX_QUEUED = 20_000  # batches held for the GUI; beyond this the oldest are dropped


def load_vllm_recording(path: str | Path, until_seq: int | None = None
                        ) -> tuple[VllmPrefixCache, int]:
    """(the cache after the recording, or after seq ``until_seq``; undecodable messages)."""
    cache = VllmPrefixCache()
    bad = 0
    try:
        for item in read_batches(path):
            if isinstance(item, VllmWireError):
                bad += 1
                continue
            if until_seq is not None and item.seq > until_seq:
                break
            apply_batch(cache, item)
    except (OSError, ValueError) as e:
        raise InspectError(str(e)) from None
    if cache.batches == 0:
        raise InspectError(f"{path}: the recording holds no vLLM event batches")
    return cache, bad


def apply_batch(cache: VllmPrefixCache, b: VllmBatch) -> None:
    if b.restarted:
        cache.clear()
    cache.apply(b.ts, b.events, b.seq)


class VllmLiveSource:
    def __init__(self, endpoint: str, *, bind: bool = False, replay_endpoint: str | None = None,
                 topic: str = "", record_path: str | None = None) -> None:
        self.cache = VllmPrefixCache()
        self.recorder = VllmRecordingWriter(record_path, endpoint) if record_path else None
        try:
            self.sub = VllmSubscriber(endpoint, bind=bind, replay_endpoint=replay_endpoint,
                                      topic=topic, recorder=self.recorder)
        except OSError as e:
            if self.recorder is not None:
                self.recorder.close()
            raise InspectError(str(e)) from None
        self._queue: deque[VllmBatch] = deque(maxlen=MAX_QUEUED)
        self.refused: str | None = None  # the last batch the cache refused: why
        self.refused_batches = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvscope-vllm-source",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                b = self.sub.recv(0.1)
                if b is not None:
                    self._queue.append(b)
        finally:
            self.sub.close()
            if self.recorder is not None:
                self.recorder.close()

    def drain(self) -> int:
        """Apply the queued batches (GUI thread); returns how many. A batch the cache
        refuses (past its limit: ``IndexFull``) is counted and named in ``status``."""
        n = 0
        while self._queue:
            try:
                apply_batch(self.cache, self._queue.popleft())
            except IndexFull as e:
                self.refused, self.refused_batches = str(e), self.refused_batches + 1
            n += 1
        return n

    def status(self) -> dict[str, Any]:
        s = self.sub
        verb = "listening on" if s.bound else "connected to"
        return {"where": f"{verb} {s.endpoint}", "batches": self.cache.batches,
                "last_seq": s.last_seq, "errors": s.errors + self.refused_batches,
                "last_error": self.refused or s.last_error,
                "gaps": s.gaps, "missed": s.missed, "restarts": s.restarts,
                "recorded": self.recorder.messages if self.recorder else None}

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2.0)
