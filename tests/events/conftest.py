"""Helpers for the event-stream tests: polling with deadlines (no sleeps), a TCP proxy
that can cut a live connection, the reference workload, and the check that events fit
their declared types."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import pytest

from kvscope.engine.events import KVState
from kvscope.engine.events import schema as S
from kvscope.engine.events.wire import EventStream
from kvscope.engine.events.wire.subscriber import Subscriber
from tests.waiting import HANG_S


def poll_until(subs: list[Subscriber], done: Callable[[], bool],
               timeout: float = HANG_S) -> None:
    """Poll every subscriber until ``done()``; fail the test at the deadline (a hang
    guard: a healthy run takes milliseconds)."""
    end = time.monotonic() + timeout
    while not done():
        if time.monotonic() > end:
            raise AssertionError(
                "timed out: " + "; ".join(
                    f"status={s.status} last_seq={s.last_seq} gaps={s.gaps} "
                    f"errors={dict(s.codec.errors)}" for s in subs))
        for s in subs:
            s.poll(0.02)


def synced_to(subs: list[Subscriber], seq: int) -> Callable[[], bool]:
    return lambda: all(s.status != "waiting" and s.last_seq >= seq for s in subs)


def cache_stream(cache, *args, **kwargs) -> EventStream:
    """An EventStream whose snapshots come from ``cache`` (a SyntheticCache: the engine's
    cache stand-in), as LLMEngine wires it: steps run under ``stream.engine_lock``."""
    return EventStream(*args, snapshot_fn=cache.canonical, engine_lock=threading.Lock(),
                       **kwargs)


def assert_declared(events: Iterable[dict[str, Any]]) -> None:
    """Every event is of a declared kind and fits its type (engine.events.schema): each
    field it carries is declared with that type, every required field is there. (Lists
    in the engine may be tuples: a msgpack array either way.)"""
    for ev in events:
        cls = S.EVENT_TYPES.get(ev["kind"])
        assert cls is not None, f"undeclared kind {ev['kind']!r}"
        undeclared = set(ev) - {"kind", *cls.__struct_fields__}
        assert not undeclared, f"{ev['kind']} carries undeclared {sorted(undeclared)}"
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(ev))  # tuples -> lists
        try:
            msgspec.convert(wire, cls)
        except msgspec.ValidationError as e:
            raise AssertionError(f"{ev['kind']} does not fit its type: {e} ({ev})") from None


def apply_all(batches: list[dict]) -> KVState:
    st = KVState()
    for b in batches:
        st.apply(b)
    return st


class TcpProxy:
    """Forwards 127.0.0.1:self.port to 127.0.0.1:target; ``cut()`` drops every
    connection and refuses new ones until ``restore()`` (a cable pulled and replugged)."""

    def __init__(self, target: int) -> None:
        self.target = target
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self._want_open = True
        self._stop = False
        self.connections = 0
        self._cut_done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def cut(self) -> None:
        """Returns once every connection is closed (the proxy thread confirms)."""
        self._cut_done.clear()
        self._want_open = False
        if not self._cut_done.wait(HANG_S):
            raise AssertionError("proxy did not cut its connections")

    def restore(self) -> None:
        self._want_open = True

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)

    def _run(self) -> None:
        listener: socket.socket | None = None
        peer: dict[socket.socket, socket.socket] = {}

        def drop_all() -> None:
            for s in list(peer):
                s.close()
            peer.clear()

        while not self._stop:
            if self._want_open and listener is None:
                listener = socket.socket()
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind(("127.0.0.1", self.port))
                listener.listen()
            if not self._want_open and listener is not None:
                listener.close()
                listener = None
                drop_all()
                self._cut_done.set()
            watch = list(peer) + ([listener] if listener is not None else [])
            ready, _, _ = select.select(watch, [], [], 0.02)
            for s in ready:
                if s is listener:
                    client, _ = listener.accept()
                    upstream = socket.create_connection(("127.0.0.1", self.target))
                    peer[client], peer[upstream] = upstream, client
                    self.connections += 1
                    continue
                if s not in peer:
                    continue
                try:
                    data = s.recv(65536)
                except OSError:
                    data = b""
                other = peer[s]
                if not data:
                    for x in (s, other):
                        peer.pop(x, None)
                        x.close()
                    continue
                other.sendall(data)
        drop_all()
        if listener is not None:
            listener.close()


@pytest.fixture
def tcp_proxy():
    proxies: list[TcpProxy] = []

    def make(target: int) -> TcpProxy:
        proxies.append(TcpProxy(target))
        return proxies[-1]

    yield make
    for p in proxies:
        p.close()


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])
