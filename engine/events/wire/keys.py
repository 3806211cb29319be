"""CURVE keys for the event stream: who may watch an engine from another machine.

ZeroMQ's CURVE (libzmq's own CurveZMQ: authentication and encryption) secures both
sockets of an ``EventStream`` publisher (PUB and the snapshot/replay ROUTER). Both sides
authenticate:

- the publisher is the CURVE server. It holds ``server.key_secret`` and accepts only
  clients whose public keys lie in ``allowed_clients/`` (a ZAP handler,
  ``zmq.auth.ThreadAuthenticator``, checks every handshake); any other client's
  handshake fails and it gets nothing;
- the subscriber is a CURVE client. It holds its own pair (``client.key_secret``) and
  the server's public key (``server.key``): the handshake succeeds only against a
  publisher that holds the matching secret, so a client never reads a stream from an
  impostor.

A key directory, as ``kvscope keys DIR`` (``make_keys``) writes it; zmq.auth's
certificate files (``zmq.auth.load_certificate`` reads them)::

    DIR/server.key            the publisher's public key      (both sides)
    DIR/server.key_secret     the publisher's secret          (the engine's machine only)
    DIR/client.key            a client's public key
    DIR/client.key_secret     a client's secret               (the watching machine)
    DIR/allowed_clients/client.key   public keys the publisher accepts (add more here)

The engine side reads ``server.key_secret`` and ``allowed_clients/`` (``ServerKeys``);
the watching side reads ``client.key_secret`` and ``server.key`` (``ClientKeys``). The
allowed keys are read when the publisher starts.

An events socket bound anywhere but loopback (or ipc://) without keys is refused
(``check_bind``): the stream shows every request's token-block hashes and timing.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth

ENV_KEYS = "KVSCOPE_EVENTS_KEYS"  # the key directory, for the vLLM plugin
ALLOWED = "allowed_clients"
HOW_TO_MAKE = ("make keys with `kvscope keys DIR`, then pass the directory to the "
               "publisher (`kvscope serve --events-keys DIR`, or KVSCOPE_EVENTS_KEYS=DIR "
               "for the vLLM plugin) and to the client (`kvscope inspect --connect ... "
               "--keys DIR`)")
_TCP_HOST = re.compile(r"^tcp://(?:[^;]*;)?(?P<host>\[[^\]]*\]|[^:\[\]]+):[^:]+$")


class KeysError(ValueError):
    """A key directory that cannot be used (missing or malformed files)."""


def make_keys(directory: str | os.PathLike[str], force: bool = False) -> dict[str, Path]:
    """Write a server pair, a client pair and ``allowed_clients/client.key`` (the module
    docstring's layout) into ``directory`` (created if absent). Refuses to overwrite keys
    already there unless ``force``. Secret files are made readable by their owner only.
    Returns the paths written, by role."""
    d = Path(directory)
    allowed = d / ALLOWED
    names = ("server.key", "server.key_secret", "client.key", "client.key_secret")
    if not force:
        there = [n for n in names if (d / n).exists()]
        if there:
            raise KeysError(f"{d} already holds {', '.join(there)}; keep them, or pass "
                            "--force to replace them (clients holding the old keys are "
                            "then refused)")
    if d.exists() and not d.is_dir():
        raise KeysError(f"{d} is not a directory")
    allowed.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    for role in ("server", "client"):
        public, secret = zmq.auth.create_certificates(d, role)
        os.chmod(secret, 0o600)
        out[f"{role}_public"], out[f"{role}_secret"] = Path(public), Path(secret)
    dest = allowed / "client.key"
    dest.write_bytes(out["client_public"].read_bytes())
    out["allowed_client"] = dest
    return out


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise KeysError(f"no key file {path} ({HOW_TO_MAKE})")
    try:
        public, sec = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as e:
        raise KeysError(f"cannot read the key file {path}: {e}") from None
    if secret and not sec:
        raise KeysError(f"{path} holds no secret key (expected a .key_secret file)")
    if len(public) != 40 or (sec is not None and len(sec) != 40):
        raise KeysError(f"{path} does not hold a Z85 CURVE key (40 characters)")
    return public, sec


@dataclass(frozen=True)
class ServerKeys:
    """The publisher's side: its key pair and the directory of allowed client keys
    (non-empty: a publisher that allows nobody would be useless)."""

    public: bytes
    secret: bytes
    allowed_dir: Path

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> ServerKeys:
        d = Path(directory)
        public, secret = _load(d / "server.key_secret", secret=True)
        allowed = d / ALLOWED
        if not allowed.is_dir() or not any(allowed.glob("*.key")):
            raise KeysError(f"{allowed} holds no client keys (*.key): no client could "
                            f"attach ({HOW_TO_MAKE})")
        for f in allowed.glob("*.key"):
            _load(f, secret=False)  # a malformed one is an error now, not a silent refusal
        assert secret is not None
        return cls(public, secret, allowed)


@dataclass(frozen=True)
class ClientKeys:
    """The subscriber's side: its key pair and the server's public key."""

    public: bytes
    secret: bytes
    server_public: bytes

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> ClientKeys:
        d = Path(directory)
        public, secret = _load(d / "client.key_secret", secret=True)
        server, _ = _load(d / "server.key", secret=False)
        assert secret is not None
        return cls(public, secret, server)

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` a CURVE client of the server (before it connects)."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.server_public


def server_keys(keys: ServerKeys | str | os.PathLike[str] | None) -> ServerKeys | None:
    """``keys`` as ServerKeys (a directory is loaded; KeysError if it cannot be)."""
    return keys if keys is None or isinstance(keys, ServerKeys) else ServerKeys.load(keys)


def client_keys(keys: ClientKeys | str | os.PathLike[str] | None) -> ClientKeys | None:
    """``keys`` as ClientKeys (a directory is loaded; KeysError if it cannot be)."""
    return keys if keys is None or isinstance(keys, ClientKeys) else ClientKeys.load(keys)


def is_local(endpoint: str) -> bool:
    """True for endpoints only this machine can reach: ipc://, inproc://, and tcp:// on a
    loopback address (127.0.0.0/8, ::1, localhost). Anything else (``*``, 0.0.0.0, an
    interface name, another address or host name) is not."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    m = _TCP_HOST.match(endpoint)
    if m is None:
        return False
    host = m["host"].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(endpoint: str, keys: object | None, what: str = "the events socket") -> None:
    """ValueError when ``endpoint`` is not local (``is_local``) and no keys are given:
    the message says how to make them. The check binds nothing."""
    if keys is None and not is_local(endpoint):
        raise ValueError(f"refusing to bind {what} to {endpoint} without keys: anyone who "
                         f"can reach it could read the cache events; {HOW_TO_MAKE}; or "
                         "bind 127.0.0.1 and tunnel (ssh -L)")


def curve_available() -> bool:
    """libzmq was built with CURVE (libsodium or its own tweetnacl)."""
    return bool(zmq.has("curve"))
