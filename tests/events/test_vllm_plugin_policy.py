"""The vLLM plugin's capability policy and configuration, with stand-in vLLM modules (the
real vLLMs are in test_vllm_plugin.py and test_vllm033_plugin.py): unconfigured it
touches nothing, not even vLLM's import; a vLLM whose wrapped methods or blocks differ
from what the plugin reads (whatever its version string) gets one warning and nothing
patched; one whose methods have the shape it reads is wrapped (the methods, never the
classes), with vLLM's further parameters forwarded; a failure of its reader turns it off
and vLLM's call still returns."""

from __future__ import annotations

import dataclasses
import functools
import logging
import sys
import types

import pytest

from kvscope.engine.events.vllm import plugin


class Scheduler:  # with vLLM's parameter names (0.32 and 0.33 alike)
    def update_from_output(self, scheduler_output, model_runner_output=None):
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


@dataclasses.dataclass(slots=True)
class KVCacheBlock:  # the fields the reader reads of vLLM's block (0.32 and 0.33 alike)
    block_id: int
    ref_cnt: int = 0
    _block_hash: bytes | None = None
    is_null: bool = False


TRACKED = [name for name in plugin.TRACKED]


def _fake_vllm(monkeypatch, version: str, scheduler_cls: type = Scheduler,
               pool_cls: type = BlockPool, block_cls: type | None = KVCacheBlock) -> None:
    mods = {
        "vllm": types.SimpleNamespace(__version__=version),
        "vllm.v1": types.ModuleType("vllm.v1"),
        "vllm.v1.core": types.ModuleType("vllm.v1.core"),
        "vllm.v1.core.block_pool": types.SimpleNamespace(BlockPool=pool_cls),
        "vllm.v1.core.kv_cache_utils": types.SimpleNamespace(
            **({"KVCacheBlock": block_cls} if block_cls else {})),
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


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.34.1", "1.0.0"])
def test_any_version_with_the_shapes_it_reads_is_wrapped(monkeypatch, version):
    """By capability, not version string: 0.34 with 0.33's methods is read too."""
    monkeypatch.setenv(plugin.ENV_RECORD, "run.kvtrace")
    _fake_vllm(monkeypatch, version)
    before = _originals()
    plugin.register()
    assert plugin._state["patched"]
    assert all(a is not b for a, b in zip(_originals(), before, strict=True))


def test_a_method_another_plugin_wrapped_with_functools_wraps_is_read_through(monkeypatch):
    monkeypatch.setenv(plugin.ENV_RECORD, "run.kvtrace")
    _fake_vllm(monkeypatch, "0.33.0", WrappedWithWraps)
    plugin.register()
    assert plugin._state["patched"]


def test_further_parameters_are_forwarded_untouched(monkeypatch, tmp_path):
    """vLLM 0.33's changes the plugin does not read: a constructor that gained
    ``num_hash_lookahead_tokens`` before ``medium`` (not wrapped), methods with further
    parameters (forwarded as given, positional or keyword)."""
    class Pool033(BlockPool):
        def __init__(self, num_gpu_blocks, enable_caching, hash_block_size,
                     enable_kv_cache_events, metrics_collector, num_hash_lookahead_tokens=0,
                     medium="GPU"):
            self.lookahead, self.medium = num_hash_lookahead_tokens, medium

        def touch(self, blocks, extra=None):
            self.seen, self.extra = list(blocks), extra

    class Scheduler033(Scheduler):
        def _preempt_request(self, request, timestamp, drop_stale_output=False):
            return (timestamp, drop_stale_output)

    monkeypatch.setenv(plugin.ENV_RECORD, str(tmp_path / "run.kvtrace"))
    _fake_vllm(monkeypatch, "0.33.0", Scheduler033, Pool033)
    init = Pool033.__init__
    plugin.register()
    assert plugin._state["patched"] and Pool033.__init__ is init
    pool = Pool033(10, True, 16, False, None, 4, "CPU")
    assert (pool.lookahead, pool.medium) == (4, "CPU")
    pool._kvscope_touched = plugin.Touched()
    pool.touch([Blk(3)], "x")
    assert pool.extra == "x" and pool._kvscope_touched.ids == {3}
    pool.touch(blocks=[Blk(4)], extra="y")
    assert pool.extra == "y" and pool._kvscope_touched.ids == {3, 4}
    s = Scheduler033()
    assert s._preempt_request(object(), 1.0, True) == (1.0, True)
    assert s._preempt_request(object(), 2.0, drop_stale_output=True) == (2.0, True)


class ReorderedPool(BlockPool):
    def touch(self, req, blocks):  # a vLLM that put a parameter before the blocks
        self.seen = list(blocks)


class RenamedPool(BlockPool):
    def free_blocks(self, blocks_to_free):
        self.seen = list(blocks_to_free)


class KeywordOnlyPool(BlockPool):
    def _insert_block_hash(self, block_hash_with_group_id, *, block, num_tokens):
        self.seen = [block]


class _Opaque:
    __signature__ = "unreadable"  # what inspect.signature cannot read (say, a C method)

    def __call__(self, *args):
        return []


class OpaquePool(BlockPool):
    get_new_blocks = _Opaque()


class ChangedScheduler(Scheduler):
    def update_from_output(self, model_runner_output, scheduler_output):
        return "vllm's result"


class ChangedPreempt(Scheduler):
    def _preempt_request(self, victim, ts):
        return None


class OpaquelyWrapped(Scheduler):
    def update_from_output(self, *args, **kw):  # another plugin's, without functools.wraps
        return "vllm's result"


class WrappedWithWraps(Scheduler):
    @functools.wraps(Scheduler.update_from_output)
    def update_from_output(self, *args, **kw):  # another plugin's, saying what it wraps
        return "vllm's result"


@dataclasses.dataclass
class RenamedBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # not _block_hash
    is_null: bool = False


@pytest.mark.parametrize("case, scheduler_cls, pool_cls, block_cls, said", [
    ("reordered", Scheduler, ReorderedPool, KVCacheBlock,
     "BlockPool.touch takes (req) where the plugin reads (blocks)"),
    ("renamed", Scheduler, RenamedPool, KVCacheBlock,
     "BlockPool.free_blocks takes (blocks_to_free) where the plugin reads (ordered_blocks)"),
    ("keyword-only", Scheduler, KeywordOnlyPool, KVCacheBlock,
     "BlockPool._insert_block_hash takes (block_hash_with_group_id) where the plugin reads "
     "(block_hash_with_group_id, block)"),
    ("no signature", Scheduler, OpaquePool, KVCacheBlock,
     "BlockPool.get_new_blocks has no readable signature"),
    ("scheduler", ChangedScheduler, BlockPool, KVCacheBlock,
     "Scheduler.update_from_output takes (model_runner_output) where the plugin reads "
     "(scheduler_output)"),
    ("preempt", ChangedPreempt, BlockPool, KVCacheBlock,
     "Scheduler._preempt_request takes (victim)"),
    ("opaque wrapper", OpaquelyWrapped, BlockPool, KVCacheBlock,
     "Scheduler.update_from_output takes (*args) where the plugin reads (scheduler_output)"),
    ("block fields", Scheduler, BlockPool, RenamedBlock, "KVCacheBlock lacks _block_hash"),
    ("no block type", Scheduler, BlockPool, None, "KVCacheBlock is missing"),
])
def test_a_vllm_whose_wrapped_methods_differ_warns_once_and_is_untouched(
        monkeypatch, caplog, case, scheduler_cls, pool_cls, block_cls, said):
    """Whatever its version string says (here the very versions the plugin was checked
    against): what decides is the shape of what it wraps."""
    monkeypatch.setenv(plugin.ENV_RECORD, "run.kvtrace")
    _fake_vllm(monkeypatch, "0.33.0", scheduler_cls, pool_cls, block_cls)
    wrapped = [(c, n) for c in (scheduler_cls, pool_cls) for n in dir(c)
               if callable(getattr(c, n, None)) and not n.startswith("__")]
    before = [getattr(c, n) for c, n in wrapped]
    with caplog.at_level(logging.WARNING, logger="kvscope.vllm"):
        plugin.register()
        plugin.register()  # vLLM loads plugins in each process: still one warning here
    assert [getattr(c, n) for c, n in wrapped] == before
    assert not plugin._state["patched"]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, caplog.text
    assert said in warnings[0].getMessage()
    assert "vLLM 0.33.0 differs" in warnings[0].getMessage()


def test_a_missing_method_warns_and_leaves_vllm_untouched(monkeypatch, caplog):
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
    assert "Scheduler._preempt_request is missing" in caplog.text
    assert Renamed().update_from_output(None) == "vllm's result"


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
