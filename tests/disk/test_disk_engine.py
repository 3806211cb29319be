"""The disk tier in the engine: a prefix that left the device and the host is read back
from disk (prefetch, then a host hit) with token-identical outputs; a restart over the
kept directory starts warm, over an emptied one cold; torn and foreign files are never
served; a failing disk disables the tier and the engine keeps serving. The KVState
rebuilt from each recording equals the engine's state."""

from __future__ import annotations

import errno
import logging
import os
import time

from prometheus_client.parser import text_string_to_metric_families

from kvscope.engine.events import KVState
from kvscope.engine.events.wire.recording import Recording
from kvscope.engine.reference_generate import generate_reference
from kvscope.engine.runner import disk_store
from kvscope.engine.server.metrics import ServerMetrics
from tests.disk.fake_disk import dead_pid
from tests.engine.conftest import GREEDY, TEST_DTYPE, as_prompt
from tests.waiting import HANG_S

BS = 8
SYSTEM = ("You are a careful assistant. Answer briefly and precisely, and never invent "
          "facts. If a question is ambiguous, say so. ") * 3


def gib(blocks: int, loaded) -> float:
    cfg = loaded[2]
    per_block = 2 * cfg.num_layers * BS * cfg.num_kv_heads * cfg.head_dim * TEST_DTYPE.itemsize
    return (blocks + 0.5) * per_block / (1 << 30)


def disk_engine(make_engine, loaded, directory, record, **kw):
    """An engine with a disk tier that waits for its reads however slow the box: the
    prefetch wait and the per-read deadline (2 s each by default, after which a read is a
    miss) are hang guards here, so that a prefix read back is the outcome the tests see
    on a loaded machine too (a slow read given up on is tests/disk/test_disk_io.py's)."""
    eng = make_engine(block_size=BS, num_gpu_blocks=64, swap_space=gib(8, loaded),
                      disk_cache_dir=str(directory), disk_cache_size=64 << 20,
                      record_path=str(record), **{"disk_prefetch_wait_s": HANG_S, **kw})
    if eng.disk_io is not None:
        eng.disk_io.read_timeout_s = HANG_S
    return eng


def prompts(loaded):
    return [as_prompt(loaded, SYSTEM + q) for q in ("Q: What is 2+2? A:",
                                                   "Q: Name a planet. A:")]


def run(eng, rid, prompt) -> list[int]:
    eng.add_request(rid, prompt, GREEDY)
    got = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                got = out.outputs[0].token_ids
        eng.cache.check_invariants()
    return got


def spill_to_disk(eng) -> None:
    """Push every cached block down to disk and wait until the files are written."""
    eng.cache.evict_cached()  # gpu -> host
    eng.cache.pools["cpu"].evict()  # host -> disk
    eng.step()  # performs the copies and queues the writes
    assert eng.disk_io.drain(time.monotonic() + HANG_S) == 0


def test_prefix_on_disk_is_prefetched_and_outputs_stay_identical(make_engine, loaded,
                                                                  tmp_path):
    model, tok, _ = loaded
    first, second = prompts(loaded)
    ref = generate_reference(model, tok, second["prompt_token_ids"], GREEDY).token_ids
    eng = disk_engine(make_engine, loaded, tmp_path / "kv", tmp_path / "rec")
    run(eng, "first", first)
    spill_to_disk(eng)
    m = eng.cache.metrics()
    assert m["tiers"]["disk"]["cached"] > 0 and m["tiers"]["cpu"]["cached"] == 0
    assert run(eng, "second", second) == ref
    d = eng.cache.disk
    assert d.prefetched_blocks > 0 and d.arrived_blocks == d.prefetched_blocks
    assert eng.cache.metrics()["host_hit_tokens"] >= d.arrived_blocks * BS
    # /metrics: the disk tier's series are the tier's own counts, under vLLM's names
    sm = ServerMetrics("m", prefix="vllm")
    sm.on_step(eng)
    got = {(s.name, s.labels.get("tier")): s.value for f in text_string_to_metric_families(
        sm.render().decode()) for s in f.samples}
    assert got[("vllm:kv_offload_tiering_block_hits_total", "disk")] == d.arrived_blocks
    assert got[("vllm:kv_offload_tiering_read_bytes_total", "disk")] == \
        eng.disk_io.stats.bytes_read > 0
    assert got[("vllm:kv_offload_tiering_write_bytes_total", "disk")] > 0
    assert got[("kvscope:kv_tier_stored_blocks_total", "disk")] == d.stored_blocks
    assert got[("kvscope:kv_prefetch_blocks_total", "disk")] == d.prefetched_blocks
    assert got[("vllm:kv_offload_tiering_block_hits_total", "cpu")] * BS == \
        eng.cache.metrics()["host_hit_tokens"]
    eng.close()  # its stop writes the cached blocks down: compare after it
    expected = eng.kv_state()
    state = KVState()
    for batch in Recording(tmp_path / "rec"):
        state.apply(batch)
    assert state.canonical() == expected
    assert state.kind_counts.get("prefetch") and state.kind_counts.get("disk_load")


def test_restart_with_directory_kept_starts_warm_emptied_starts_cold(make_engine, loaded,
                                                                     tmp_path):
    model, tok, _ = loaded
    first, second = prompts(loaded)
    ref = generate_reference(model, tok, second["prompt_token_ids"], GREEDY).token_ids
    eng = disk_engine(make_engine, loaded, tmp_path / "kv", tmp_path / "r0")
    run(eng, "first", first)
    eng.close()  # the graceful stop writes the cached prefix to disk
    files = [n for n in os.listdir(tmp_path / "kv") if n.endswith(disk_store.SUFFIX)]
    assert files
    assert oct(os.stat(tmp_path / "kv").st_mode & 0o777) == "0o700"
    warm = disk_engine(make_engine, loaded, tmp_path / "kv", tmp_path / "r1")
    assert warm.cache.metrics()["tiers"]["disk"]["cached"] == len(files)
    assert run(warm, "second", second) == ref
    assert warm.cache.disk.arrived_blocks > 0
    warm_hits = warm.cache.metrics()["prefix_hit_tokens"]
    assert warm_hits > 0
    warm.close()
    expected = warm.kv_state()
    state = KVState()
    for batch in Recording(tmp_path / "r1"):
        state.apply(batch)
    assert state.canonical() == expected
    for n in os.listdir(tmp_path / "kv"):  # emptied
        if n.endswith(disk_store.SUFFIX):
            os.unlink(tmp_path / "kv" / n)
    cold = disk_engine(make_engine, loaded, tmp_path / "kv", tmp_path / "r2")
    assert run(cold, "second", second) == ref
    assert cold.cache.metrics()["prefix_hit_tokens"] == 0
    cold.close()


def test_torn_and_foreign_files_are_never_served(make_engine, loaded, tmp_path):
    model, tok, _ = loaded
    first, second = prompts(loaded)
    ref = generate_reference(model, tok, second["prompt_token_ids"], GREEDY).token_ids
    eng = disk_engine(make_engine, loaded, tmp_path / "kv", tmp_path / "r0")
    run(eng, "first", first)
    eng.close()
    kv = tmp_path / "kv"
    files = sorted(n for n in os.listdir(kv) if n.endswith(disk_store.SUFFIX))
    for i, n in enumerate(files):  # flip a payload bit in each; truncate one
        data = bytearray((kv / n).read_bytes())
        data[-1 - i] ^= 0x04
        (kv / n).write_bytes(bytes(data[:-1]) if i == 0 else bytes(data))
    # a dead writer's leftover (a live one's temporary files are left alone)
    (kv / f"{disk_store.TMP_PREFIX}{dead_pid()}-{files[0]}").write_bytes(b"torn write")
    eng = disk_engine(make_engine, loaded, kv, tmp_path / "r1")
    assert eng.cache.metrics()["tiers"]["disk"]["cached"] == len(files) - 1  # truncated: out
    assert run(eng, "second", second) == ref  # bad reads are misses: recomputed
    assert eng.cache.disk.read_misses > 0 and eng.cache.disk.arrived_blocks == 0
    eng.close()
    # another block size is another fingerprint: its engine ignores and removes our files
    run_other = make_engine(block_size=16, num_gpu_blocks=64, swap_space=gib(8, loaded),
                            disk_cache_dir=str(kv), disk_cache_size=64 << 20)
    assert run_other.cache.metrics()["tiers"]["disk"]["cached"] == 0
    run_other.close()
    assert not [n for n in os.listdir(kv) if n.endswith(disk_store.SUFFIX)]


def test_disk_full_disables_the_tier_and_serving_goes_on(make_engine, loaded, tmp_path,
                                                        monkeypatch, caplog):
    model, tok, _ = loaded
    first, second = prompts(loaded)
    ref = generate_reference(model, tok, second["prompt_token_ids"], GREEDY).token_ids
    real_write = os.write

    def full(fd, data):
        if os.fstat(fd).st_size >= 0 and "kv" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full)
    eng = disk_engine(make_engine, loaded, tmp_path / "kv", tmp_path / "rec")
    with caplog.at_level(logging.WARNING):
        run(eng, "first", first)
        eng.cache.evict_cached()
        eng.cache.pools["cpu"].evict()
        eng.step()
        eng.disk_io.drain(time.monotonic() + HANG_S)
        assert run(eng, "second", second) == ref
    monkeypatch.setattr(os, "write", real_write)
    assert eng.disk_io.store.disabled and not eng.cache.disk.enabled
    assert eng.cache.metrics()["tiers"]["disk"]["cached"] == 0
    assert len([r for r in caplog.records if "disk KV tier" in r.message
                and "disabled" in r.message]) == 1
    eng.close()  # its stop writes the cached blocks down: compare after it
    expected = eng.kv_state()
    state = KVState()
    for batch in Recording(tmp_path / "rec"):
        state.apply(batch)
    assert state.canonical() == expected


def test_second_engine_on_a_directory_runs_without_its_disk_tier(make_engine, loaded,
                                                                   tmp_path, caplog):
    """Defect 6: two daemons on one directory broke each other's tiers. The engine holds
    the directory's lock while it runs: a second one serves without a disk tier (one
    warning naming the first's pid) and leaves the first's files alone; once the first
    stops, the directory is free again."""
    model, tok, _ = loaded
    first, second = prompts(loaded)
    ref = generate_reference(model, tok, second["prompt_token_ids"], GREEDY).token_ids
    kv = tmp_path / "kv"
    eng = disk_engine(make_engine, loaded, kv, tmp_path / "r0")
    run(eng, "first", first)
    spill_to_disk(eng)
    files = sorted(os.listdir(kv))
    assert any(n.endswith(disk_store.SUFFIX) for n in files)
    with caplog.at_level(logging.WARNING):
        other = make_engine(block_size=16, num_gpu_blocks=64, swap_space=gib(8, loaded),
                            disk_cache_dir=str(kv), disk_cache_size=64 << 20)
    try:
        assert other.disk_io.store.disabled
        assert f"pid {os.getpid()}" in other.disk_io.store.error
        assert "one daemon per directory" in caplog.text
        assert sorted(os.listdir(kv)) == files  # another fingerprint: nothing deleted
        assert run(eng, "second", second) == ref  # the first serves on, its tier on
        assert not eng.disk_io.store.disabled and eng.cache.disk.enabled
    finally:
        other.close()
        eng.close()
    again = disk_engine(make_engine, loaded, kv, tmp_path / "r1")
    try:
        assert not again.disk_io.store.disabled
        assert again.cache.metrics()["tiers"]["disk"]["cached"] > 0
    finally:
        again.close()
