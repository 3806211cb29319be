"""Remote attach with CURVE keys (engine.events.wire.keys): a client holding the right
keys gets the stream and the snapshot; a client with no keys, another server's keys or
a key the publisher does not list gets nothing and says why (the handshake failure is
an event from the sockets' monitors: waited for, never a clock); a plain publisher is
unaffected. Binding a non-loopback address without keys is refused before anything
binds (only the refusal is tested: tests never bind a public address)."""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

import pytest

from kvscope.engine.bench.synthetic import SyntheticCache
from kvscope.engine.cli import build_parser, main
from kvscope.engine.events import KVState
from kvscope.engine.events.vllm.plugin import Config
from kvscope.engine.events.wire import Subscriber
from kvscope.engine.events.wire import publisher as publisher_mod
from kvscope.engine.events.wire.keys import (
    ClientKeys,
    KeysError,
    ServerKeys,
    check_bind,
    is_local,
    make_keys,
)
from kvscope.engine.events.wire.publisher import Publisher
from kvscope.engine.events.wire.stream import EventStream
from tests.events.conftest import cache_stream, poll_until, synced_to
from tests.events.test_live_stream import run_steps

EP = "tcp://127.0.0.1:0"


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    d = tmp_path / "keys"
    make_keys(d)
    return d


def _failed(sub: Subscriber):
    """The handshake failed, or (what the test then reports) something got through."""
    return lambda: sub.problem is not None or sub.live_messages > 0 or sub.status != "waiting"


# ------------------------------------------------------------------ the key files
def test_keys_command_writes_a_layout_both_sides_can_load(tmp_path, capsys):
    d = tmp_path / "k"
    assert main(["keys", str(d)]) == 0
    out = capsys.readouterr().out
    assert "--events-keys" in out and "--keys" in out
    server, client = ServerKeys.load(d), ClientKeys.load(d)
    assert client.server_public == server.public  # the client verifies this server
    assert client.public != server.public
    # the server accepts exactly the client's public key
    assert (d / "allowed_clients" / "client.key").read_bytes() == (d / "client.key").read_bytes()
    for secret in ("server.key_secret", "client.key_secret"):
        assert stat.S_IMODE((d / secret).stat().st_mode) == 0o600
    # a second run keeps the keys (clients hold them) unless told to replace them
    assert main(["keys", str(d)]) == 2
    assert "--force" in capsys.readouterr().err
    assert ClientKeys.load(d).public == client.public
    assert main(["keys", str(d), "--force"]) == 0
    assert ClientKeys.load(d).public != client.public


def test_unusable_key_directories_are_clear_errors(tmp_path, keys):
    with pytest.raises(KeysError, match="kvscope keys"):
        ServerKeys.load(tmp_path / "nowhere")
    with pytest.raises(KeysError, match="kvscope keys"):
        Subscriber("tcp://127.0.0.1:1", keys=tmp_path / "nowhere")
    (keys / "allowed_clients" / "client.key").unlink()
    with pytest.raises(KeysError, match="no client keys"):
        ServerKeys.load(keys)
    (keys / "client.key_secret").write_text("not a certificate\n")
    with pytest.raises(KeysError):
        ClientKeys.load(keys)


# ------------------------------------------------------------------ on the wire
def test_a_client_with_the_right_keys_gets_the_snapshot_and_the_stream(keys):
    gen = SyntheticCache(seed=21)
    with cache_stream(gen, EP, heartbeat_s=0.2, keys=keys) as stream:
        run_steps(stream, gen, 20)  # a state to join: the first update is a snapshot
        with Subscriber(stream.endpoint, stream.snapshot_endpoint, keys=keys) as sub:
            poll_until([sub], synced_to([sub], stream.seq))
            assert sub.state.canonical() == gen.canonical()
            run_steps(stream, gen, 60, [sub])  # then every batch, live
            assert sub.batches_applied > 0 and sub.errors == 0
            assert sub.problem is None and sub.handshake_failures == 0
        assert stream.stats.snapshots_served >= 1


def _other_server(tmp_path: Path) -> Path:
    d = tmp_path / "other"
    make_keys(d)
    return d


def _unlisted_client(tmp_path: Path, keys: Path) -> Path:
    """The right server key, but a client pair the publisher does not list."""
    d = tmp_path / "unlisted"
    make_keys(d)
    shutil.copy(keys / "server.key", d / "server.key")
    return d


@pytest.mark.parametrize(("who", "says"), [
    ("no keys", "requires keys"),
    ("another server's keys", "does not hold the secret of our server.key"),
    ("an unlisted client key", "refused this client's key"),
])
def test_a_client_without_the_right_keys_gets_nothing_and_says_why(tmp_path, keys, who, says):
    client_keys = {"no keys": None, "another server's keys": _other_server(tmp_path),
                   "an unlisted client key": _unlisted_client(tmp_path, keys)}[who]
    gen = SyntheticCache(seed=22)
    with cache_stream(gen, EP, heartbeat_s=0.2, keys=keys) as stream, \
            Subscriber(stream.endpoint, stream.snapshot_endpoint, keys=keys) as good:
        run_steps(stream, gen, 10, [good])
        with Subscriber(stream.endpoint, stream.snapshot_endpoint, keys=client_keys) as bad:
            poll_until([bad], _failed(bad))  # the handshake failure arrives as an event
            run_steps(stream, gen, 30, [good])  # the stream goes on
            poll_until([good], synced_to([good], stream.seq))
            for _ in range(5):
                assert bad.poll(0.02) == []  # returns (never hangs), with nothing
            assert bad.status == "waiting" and bad.epoch is None
            assert bad.live_messages == 0 and bad.batches_applied == 0
            assert bad.problem is not None and says in bad.problem, bad.problem
            assert bad.state.canonical() == KVState().canonical()
        assert good.state.canonical() == gen.canonical()


def test_a_keyed_client_of_a_plain_publisher_says_so(keys):
    gen = SyntheticCache(seed=23)
    with cache_stream(gen, EP, heartbeat_s=0.2) as stream, \
            Subscriber(stream.endpoint, stream.snapshot_endpoint, keys=keys) as sub:
        run_steps(stream, gen, 5)
        poll_until([sub], _failed(sub))
        assert "does not use keys" in sub.problem
        assert sub.live_messages == 0 and sub.status == "waiting"


def test_a_plain_publisher_and_subscriber_are_unaffected():
    gen = SyntheticCache(seed=24)
    with cache_stream(gen, EP, heartbeat_s=0.2) as stream, \
            Subscriber(stream.endpoint, stream.snapshot_endpoint) as sub:
        assert stream.publisher is not None and stream.publisher.keys is None
        run_steps(stream, gen, 30, [sub])
        assert sub.problem is None and sub.handshake_failures == 0


# ------------------------------------------------------------------ binding
@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5557", "tcp://127.3.4.5:0",
                                      "tcp://localhost:5557", "tcp://[::1]:5557",
                                      "ipc:///tmp/kvscope-events", "inproc://events"])
def test_local_endpoints(endpoint):
    assert is_local(endpoint)
    check_bind(endpoint, None)


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5557", "tcp://*:5557", "tcp://[::]:5557",
                                      "tcp://10.1.2.3:5557", "tcp://eth0:5557",
                                      "tcp://gpu-host.example:5557", "udp://127.0.0.1:5557"])
def test_public_endpoints_are_refused_without_keys_before_binding(monkeypatch, keys, endpoint):
    assert not is_local(endpoint)

    def no_bind(*a, **k):
        raise AssertionError("bound a socket")

    monkeypatch.setattr(publisher_mod, "_bind", no_bind)
    with pytest.raises(ValueError, match="kvscope keys DIR") as e:
        EventStream(endpoint)
    assert endpoint in str(e.value)
    check_bind(endpoint, ServerKeys.load(keys))  # with keys it would be allowed


def test_a_public_snapshot_endpoint_is_refused_too(monkeypatch):
    monkeypatch.setattr(publisher_mod, "_bind", lambda *a: pytest.fail("bound a socket"))
    with pytest.raises(ValueError, match="snapshot/replay socket"):
        Publisher(EP, "tcp://0.0.0.0:5558", "e")


def test_serve_refuses_a_public_events_address_without_keys(capsys, tmp_path, keys):
    assert main(["serve", "dummy:tiny", "--events", "tcp://0.0.0.0:5557"]) == 2
    err = capsys.readouterr().err
    assert "refusing to bind" in err and "kvscope keys DIR" in err
    assert main(["serve", "dummy:tiny", "--events", "tcp://0.0.0.0:5557",
                 "--events-keys", str(tmp_path / "empty")]) == 2
    assert "no key file" in capsys.readouterr().err
    # with keys the config is accepted (nothing is bound here: only the config is built)
    from kvscope.engine.commands.serve import engine_config, model_of

    args = build_parser().parse_args(["serve", "dummy:tiny", "--events", "tcp://0.0.0.0:5557",
                                      "--events-keys", str(keys)])
    args.model = model_of(args)
    assert engine_config(args).events_keys == str(keys)


def test_client_commands_check_their_keys(capsys, tmp_path):
    assert main(["inspect", "--keys", str(tmp_path)]) == 2
    assert main(["record", "--connect", "tcp://127.0.0.1:1", "-o", str(tmp_path / "r.kvtrace"),
                 "--keys", str(tmp_path / "none")]) == 2
    assert "no key file" in capsys.readouterr().err


def test_the_vllm_plugin_reads_its_keys_for_every_rank(keys):
    cfg = Config({"KVSCOPE_EVENTS": "tcp://0.0.0.0:5557", "KVSCOPE_EVENTS_KEYS": str(keys)})
    assert cfg.keys == str(keys) and cfg.for_rank(2).keys == str(keys)
    assert cfg.for_rank(2).endpoint == "tcp://0.0.0.0:5559"
    assert Config({"KVSCOPE_EVENTS": "tcp://127.0.0.1:5557"}).keys is None


def _stub_scheduler():
    """What the plugin's Producer reads of a vLLM scheduler when it opens its stream."""
    from types import SimpleNamespace as NS

    pool = NS(num_gpu_blocks=16, enable_caching=True)
    manager = NS(kv_cache_spec=NS(block_size=16))
    return NS(kv_cache_manager=NS(block_pool=pool, coordinator=NS(
        single_type_managers=[manager])), vllm_config=None)


def test_the_vllm_plugin_refuses_a_public_address_without_keys(monkeypatch, caplog):
    from kvscope.engine.events.vllm.plugin import Producer

    monkeypatch.setattr(publisher_mod, "_bind", lambda *a: pytest.fail("bound a socket"))
    p = Producer(_stub_scheduler(), Config({"KVSCOPE_EVENTS": "tcp://0.0.0.0:5557"}),
                 running=object(), version="0.32.0")
    assert not p.on and p.stream is None  # off, and vLLM goes on
    assert "refusing to bind" in caplog.text and "KVSCOPE_EVENTS_KEYS" in caplog.text


def test_the_vllm_plugin_publishes_to_keyed_clients_only(keys):
    from kvscope.engine.events.vllm.plugin import Producer

    p = Producer(_stub_scheduler(), Config({"KVSCOPE_EVENTS": EP,
                                            "KVSCOPE_EVENTS_KEYS": str(keys)}),
                 running=object(), version="0.32.0")
    try:
        assert p.on
        stream = p.stream
        with Subscriber(stream.endpoint, stream.snapshot_endpoint, keys=keys) as good, \
                Subscriber(stream.endpoint, stream.snapshot_endpoint) as blind:
            poll_until([good, blind], lambda: good.status != "waiting" and
                       blind.problem is not None)
            assert good.epoch == stream.epoch and good.problem is None
            assert blind.live_messages == 0 and "requires keys" in blind.problem
    finally:
        p.close()
