"""The vLLM plugin's version policy and configuration, with stand-in vLLM modules (the
real vLLM is in test_vllm_plugin.py): unconfigured it touches nothing, not even vLLM's
import; on an unsupported version or a missing symbol it warns once and patches nothing;
on a supported one it wraps the four methods (never the classes); a failure of its
reader turns it off and vLLM's call still returns."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from kvscope.engine.events.vllm import plugin


class Scheduler:
    def update_from_output(self, out):
        return "vllm's result"

    def finish_requests(self, ids):
        return "finished"

    def _preempt_request(self, request, ts):
        return None


class BlockPool:
    def reset_prefix_cache(self):
        return True

    # the methods the plugin tracks, with vLLM 0.32's parameter names
    def get_new_blocks(self, num_blocks):
        return [Blk(i) for i in range(1, num_blocks + 1)]

    def touch(self, blocks):
        self.seen = list(blocks)

    def free_blocks(self, ordered_blocks):
        self.seen = list(ordered_blocks)

    def unpin_blocks(self, blocks, on_reuse):
        self.seen = list(blocks)

    def _insert_block_hash(self, block_hash_with_group_id, block, num_tokens):
        self.seen = [block]

    def _remove_cached_block_hashes(self, block):
        self.seen = [block]
        return []


class Blk:
    def __init__(self, i: int, pool=None) -> None:
        self.block_id, self.pool = i, pool


TRACKED = [name for name in plugin.TRACKED]


def _fake_vllm(monkeypatch, version: str, scheduler_cls: type = Scheduler) -> None:
    mods = {
        "vllm": types.SimpleNamespace(__version__=version),
        "vllm.v1": types.ModuleType("vllm.v1"),
        "vllm.v1.core": types.ModuleType("vllm.v1.core"),
        "vllm.v1.core.block_pool": types.SimpleNamespace(BlockPool=BlockPool),
        "vllm.v1.core.sched": types.ModuleType("vllm.v1.core.sched"),
        "vllm.v1.core.sched.scheduler": types.SimpleNamespace(Scheduler=scheduler_cls),
        "vllm.v1.request": types.SimpleNamespace(
            RequestStatus=types.SimpleNamespace(RUNNING="RUNNING")),
    }
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(plugin, "_state", {"patched": False})
    for name in ("update_from_output", "finish_requests", "_preempt_request"):
        monkeypatch.setattr(Scheduler, name, Scheduler.__dict__[name])
    for name in ("reset_prefix_cache", *TRACKED):
        monkeypatch.setattr(BlockPool, name, BlockPool.__dict__[name])
    for var in (plugin.ENV_EVENTS, plugin.ENV_RECORD):
        monkeypatch.delenv(var, raising=False)


def _originals() -> tuple:
    return (Scheduler.update_from_output, Scheduler.finish_requests,
            Scheduler._preempt_request, BlockPool.reset_prefix_cache,
            *(getattr(BlockPool, name) for name in TRACKED))


def test_unconfigured_it_does_not_even_import_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing it would raise
    before = _originals()
    plugin.register()
    assert _originals() == before and not plugin._state["patched"]


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0", "0.3.2"])
def test_an_unsupported_version_warns_and_leaves_vllm_untouched(monkeypatch, caplog,
                                                                version):
    monkeypatch.setenv(plugin.ENV_RECORD, "run.kvtrace")
    _fake_vllm(monkeypatch, version)
    before = _originals()
    with caplog.at_level(logging.WARNING, logger="kvscope.vllm"):
        plugin.register()
    assert _originals() == before
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert f"vLLM {version} is not a supported version" in caplog.text
    assert Scheduler().update_from_output(None) == "vllm's result"


def test_a_missing_symbol_warns_and_leaves_vllm_untouched(monkeypatch, caplog):
    class Renamed:  # a vLLM whose scheduler no longer has _preempt_request
        def update_from_output(self, out):
            return "vllm's result"

        def finish_requests(self, ids):
            return None

    monkeypatch.setenv(plugin.ENV_EVENTS, "tcp://127.0.0.1:0")
    _fake_vllm(monkeypatch, "0.32.0", Renamed)
    before = Renamed.update_from_output
    with caplog.at_level(logging.WARNING, logger="kvscope.vllm"):
        plugin.register()
    assert Renamed.update_from_output is before
    assert "lacks Scheduler._preempt_request" in caplog.text


def test_a_supported_version_wraps_the_methods_not_the_classes(monkeypatch):
    monkeypatch.setenv(plugin.ENV_RECORD, "run.kvtrace")
    _fake_vllm(monkeypatch, "0.32.0")
    cls = sys.modules["vllm.v1.core.sched.scheduler"].Scheduler
    before = _originals()
    plugin.register()
    assert sys.modules["vllm.v1.core.sched.scheduler"].Scheduler is cls
    assert all(a is not b for a, b in zip(_originals(), before, strict=True))
    plugin.register()  # a second load (another process's import) patches nothing twice
    assert plugin._state["patched"]


def test_the_tracked_pool_methods_note_the_block_ids_they_are_handed(monkeypatch):
    monkeypatch.setenv(plugin.ENV_RECORD, "run.kvtrace")
    _fake_vllm(monkeypatch, "0.32.0")
    plugin.register()
    pool = BlockPool()
    assert pool.free_blocks(Blk(i) for i in (1, 2)) is None  # untracked: passed through
    assert [b.block_id for b in pool.seen] == [1, 2]
    touched = pool._kvscope_touched = plugin.Touched()
    assert [b.block_id for b in pool.get_new_blocks(2)] == [1, 2]
    pool.touch([Blk(3)])
    other = object()  # a block of another pool (vLLM's free_blocks hands it on)
    pool.free_blocks(b for b in (Blk(4), Blk(5, pool=other)))  # a generator, read once
    assert [b.block_id for b in pool.seen] == [4, 5]
    pool.unpin_blocks([Blk(6)], on_reuse=None)
    pool._insert_block_hash(b"h", Blk(7), 16)
    pool._remove_cached_block_hashes(block=Blk(8))
    assert touched.ids == {1, 2, 3, 4, 6, 7, 8} and not touched.all
    pool.touch(blocks=[Blk(9)])  # by keyword
    assert 9 in touched.ids
    with pytest.raises(TypeError):  # a call shape the wrapper does not know
        pool.touch()  # vLLM's own error; the next step re-reads every block
    assert touched.all


def test_a_failing_reader_turns_the_plugin_off_and_vllm_goes_on(monkeypatch, caplog,
                                                               tmp_path):
    monkeypatch.setenv(plugin.ENV_RECORD, str(tmp_path / "run.kvtrace"))
    _fake_vllm(monkeypatch, "0.32.0")
    plugin.register()
    s = Scheduler()  # no kv_cache_manager: the reader cannot read it
    with caplog.at_level(logging.WARNING, logger="kvscope.vllm"):
        assert s.update_from_output(None) == "vllm's result"
        assert s.update_from_output(None) == "vllm's result"
    assert not s._kvscope.on
    assert "kvscope" in caplog.text


def test_data_parallel_ranks_get_their_own_port_and_recording():
    cfg = plugin.Config({plugin.ENV_EVENTS: "tcp://127.0.0.1:5557",
                         plugin.ENV_RECORD: "/tmp/x/run.kvtrace"})
    assert cfg.for_rank(0).endpoint == "tcp://127.0.0.1:5557"
    r2 = cfg.for_rank(2)
    assert r2.endpoint == "tcp://127.0.0.1:5559" and r2.record == "/tmp/x/run.rank2.kvtrace"
    assert not plugin.Config({}).enabled


def _producer_scheduler() -> Scheduler:
    """A Scheduler stand-in with the KV manager the plugin's header reads."""
    s = Scheduler()
    pool = types.SimpleNamespace(num_gpu_blocks=8, enable_caching=True)
    s.kv_cache_manager = types.SimpleNamespace(
        block_pool=pool, coordinator=types.SimpleNamespace(single_type_managers=[]))
    return s


def _free_endpoint() -> str:
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUB)
    sock.bind("tcp://127.0.0.1:*")
    ep = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    sock.close(0)
    return ep


def test_an_unwritable_recording_leaves_the_publisher_on(tmp_path, caplog):
    """A failure of one output turned the other off too: a recording path that cannot be
    opened took the publisher down with it."""
    cfg = plugin.Config({plugin.ENV_EVENTS: _free_endpoint(),
                         plugin.ENV_RECORD: str(tmp_path / "missing" / "run.kvtrace")})
    with caplog.at_level(logging.ERROR, logger="kvscope.vllm"):
        p = plugin.Producer(_producer_scheduler(), cfg, "RUNNING", "0.32.0")
    try:
        assert p.on and p.stream.publisher is not None and p.stream.recorder is None
        assert "cannot record to" in caplog.text and "publishing only" in caplog.text
    finally:
        p.close()


def test_a_busy_port_leaves_the_recording_on(tmp_path, caplog):
    """...and a busy port took the recording down with it."""
    import zmq

    ctx = zmq.Context.instance()
    squatter = ctx.socket(zmq.PUB)
    squatter.bind("tcp://127.0.0.1:*")
    try:
        cfg = plugin.Config({plugin.ENV_EVENTS: squatter.getsockopt_string(zmq.LAST_ENDPOINT),
                             plugin.ENV_RECORD: str(tmp_path / "run.kvtrace")})
        with caplog.at_level(logging.ERROR, logger="kvscope.vllm"):
            p = plugin.Producer(_producer_scheduler(), cfg, "RUNNING", "0.32.0")
        try:
            assert p.on and p.stream.recorder is not None and p.stream.publisher is None
            assert "cannot publish on" in caplog.text and "recording only" in caplog.text
        finally:
            p.close()
        assert (tmp_path / "run.kvtrace").stat().st_size > 0
    finally:
        squatter.close(0)
