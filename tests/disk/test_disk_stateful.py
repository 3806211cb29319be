"""Stateful tests of the disk tier: random walks of store, evict, restart, lookup and
corrupt, checked against a model after every step.

- ``StoreMachine`` (hypothesis) drives engine.runner.disk_store.DiskStore over a real
  directory. Model: hash -> (parent, tokens, payload) of the files that are intact.
  Invariants: a read returns exactly the model's payload for that (hash, parent, tokens)
  or None, never other bytes; a damaged file is a miss and is gone afterwards; a restart's
  verified scan finds exactly the model's files and nothing temporary survives it.
- ``test_manager_random_walk`` drives a KVCacheManager with a disk tier (fake runner
  side, tests.disk.fake_disk) through prompts with shared prefixes, spills, corrupted
  files, failed writes and restarts that adopt the directory. Invariants: the KVState
  rebuilt from the events equals the manager after every step (Mirrored); a prefix hit
  never exceeds what was computed for that exact token prefix and salt; no torn file is
  ever filled into the host; every file the disk index holds is one the directory has;
  a vLLM KV-event consumer fed through the translator (engine.events.vllm.translate)
  holds, per medium (GPU, CPU, STORAGE), exactly the mirror's hashes per tier.
"""

from __future__ import annotations

import os
import random

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvscope.engine.cache.transfers import FILL, DiskBatch
from kvscope.engine.events.vllm import kv_events_wire as W
from kvscope.engine.events.vllm.prefix_cache import VllmPrefixCache
from kvscope.engine.events.vllm.translate import MEDIUM, VllmTranslator
from kvscope.engine.runner import disk_store as D
from tests.cache.conftest import Mirrored
from tests.disk.fake_disk import FakeDisk, dead_pid

BS = 4
FP = D.fingerprint("tiny-llama", "fp32", BS, [((BS, 2, 2), "float32")] * 2)
PAYLOAD = BS * 2 * 2 * 4 * 2
HASHES = st.sampled_from([1, 2, 3, -4, 2**62, -(2**63)])
DEAD_PID = dead_pid()  # a writer that is certainly gone
DAMAGE = st.sampled_from(["flip_payload", "flip_header", "flip_tokens", "truncate",
                          "extend", "empty"])


def payload_of(seed: int) -> list[bytes]:
    half = PAYLOAD // 2
    return [bytes((seed * 7 + i + j) % 256 for j in range(half)) for i in range(2)]


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        import tempfile
        self._tmp = tempfile.TemporaryDirectory()
        self.root = os.path.join(self._tmp.name, "kv")
        self.s = D.DiskStore(self.root, FP, BS, PAYLOAD)
        self.model: dict[int, tuple[int, tuple[int, ...], bytes]] = {}

    def teardown(self) -> None:
        self._tmp.cleanup()

    @rule(h=HASHES, parent=st.integers(-3, 3), tok=st.integers(0, 9), seed=st.integers(0, 99))
    def store(self, h: int, parent: int, tok: int, seed: int) -> None:
        tokens = (tok, tok + 1, tok + 2, tok + 3)
        pl = payload_of(seed)
        assert self.s.write(h, parent, parent == 0, tokens, pl)
        self.model[h] = (parent, tokens, b"".join(pl))

    @rule(h=HASHES)
    def evict(self, h: int) -> None:
        self.s.remove(h)
        self.model.pop(h, None)

    @rule(h=HASHES)
    def lookup(self, h: int) -> None:
        want = self.model.get(h)
        if want is None:
            # any identity: nothing may come back for a hash with no intact file
            assert self.s.read(h, 0, (0, 1, 2, 3)) is None
            return
        parent, tokens, data = want
        assert self.s.read(h, parent + 1, tokens) is None  # another chain's parent
        assert self.s.read(h, parent, tokens[:-1] + (tokens[-1] + 1,)) is None
        got = self.s.read(h, parent, tokens)
        assert got is not None and bytes(got) == data

    @rule(h=HASHES, damage=DAMAGE)
    def corrupt(self, h: int, damage: str) -> None:
        path = os.path.join(self.root, D.file_name(h))
        if h not in self.model:
            return
        with open(path, "rb") as f:
            data = bytearray(f.read())
        if damage == "flip_payload":
            data[-1 - (h % 5)] ^= 0x04
        elif damage == "flip_header":
            data[27] ^= 0x01  # inside the block's own hash
        elif damage == "flip_tokens":
            data[D.HEADER.size + 4] ^= 0x01
        elif damage == "truncate":
            data = data[:len(data) // 2]
        elif damage == "extend":
            data += b"\x00"
        else:
            data = bytearray()
        with open(path, "wb") as f:
            f.write(data)
        parent, tokens, _ = self.model.pop(h)
        assert self.s.read(h, parent, tokens) is None
        assert not os.path.exists(path)  # our directory: a file that fails is removed

    @rule(h=HASHES)
    def torn_temporary(self, h: int) -> None:
        """What a writer killed mid-write leaves: a temporary file, never served. Its pid
        is one no process can have (a live writer's temporary files are left alone)."""
        name = f"{D.TMP_PREFIX}{DEAD_PID}-{D.file_name(h)}"
        with open(os.path.join(self.root, name), "wb") as f:
            f.write(b"KVSCDISK" + b"\x01" * 20)

    @rule()
    def restart(self) -> None:
        self.s = D.DiskStore(self.root, FP, BS, PAYLOAD)
        found = self.s.scan(verify=True)
        assert {e.hash: (e.parent, e.tokens) for e in found} == {
            h: (p, t) for h, (p, t, _) in self.model.items()}
        assert all(e.first == (e.parent == 0) for e in found)
        assert not any(n.startswith(D.TMP_PREFIX) for n in os.listdir(self.root))

    @invariant()
    def files_cover_the_model(self) -> None:
        names = set(os.listdir(self.root))
        assert {D.file_name(h) for h in self.model} <= names
        assert not self.s.disabled


TestDiskStoreStateful = StoreMachine.TestCase
TestDiskStoreStateful.settings = settings(
    max_examples=30, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------- manager walk
PREFIXES = [list(range(1, 13)), list(range(100, 112)), list(range(1, 9)) + [50, 51, 52, 53]]


class TranslatedMirror(Mirrored):
    """Mirrored, plus a vLLM-format consumer of the same events (one per process: a
    restarted engine starts a new publisher)."""

    def __init__(self, *a, **kw) -> None:
        self.tr, self.consumer, self.enc = VllmTranslator(), VllmPrefixCache(), W.Encoder()
        self.media: set[str] = set()
        super().__init__(*a, **kw)
        self.sink.store_detail = True

    def sync(self) -> list[dict]:
        events = super().sync()
        out = W.decode(self.enc.encode(float(self.step), self.tr.translate(
            {"seq": self.step, "events": events}), 0))
        self.consumer.apply(out["ts"], out["events"], self.step)
        self.media.update(e["medium"] for e in out["events"] if e.get("medium"))
        for tier, t in self.state.tiers.items():
            assert self.consumer.hashes(MEDIUM[tier]) == set(t.hashes.values()), tier
        assert self.tr.undescribed == 0 and self.consumer.unknown_removed == 0
        return events


def _prompt(rng: random.Random) -> list[int]:
    base = rng.choice(PREFIXES)
    tail = [rng.randrange(3000, 4000) for _ in range(rng.randrange(1, 6))]
    return base[:rng.choice([4, 8, 12])] + tail


def _computed_hit(done: set[tuple[str | None, tuple[int, ...]]], salt: str | None,
                  prompt: list[int]) -> int:
    """The longest block-aligned prefix of ``prompt`` (short of its last token) that some
    finished prompt with the same salt computed."""
    best = 0
    for n in range(BS, len(prompt), BS):
        if (salt, tuple(prompt[:n])) in done:
            best = n
    return best


def _step(x: Mirrored, disk: FakeDisk) -> None:
    """The runner's side of one step: perform the rounds, report, end the step; no torn
    file's bytes are ever filled into the host."""
    for r in disk.run(x.m):
        if isinstance(r, DiskBatch):
            for op in r:
                assert not (op.kind == FILL and op.hash in disk.bad_files)
    disk.report(x.m)
    x.sync()


def test_manager_random_walk():
    seen: dict[str, int] = {}  # what the walks exercised (each must happen)
    media: set[str] = set()
    for seed in range(20):
        rng = random.Random(seed)
        disk = FakeDisk()

        def fresh() -> Mirrored:
            return TranslatedMirror(5, BS, num_cpu_blocks=3, num_disk_blocks=10)

        x = fresh()
        done: set[tuple[str | None, tuple[int, ...]]] = set()
        for i in range(40):
            op = rng.random()
            if op < 0.55:
                salt = rng.choice([None, None, "t"])
                prompt = _prompt(rng)
                sid = f"s{seed}-{i}"
                x.m.add_sequence(sid, prompt, cache_salt=salt)
                for _ in range(4):  # wait for the prefetch, a bounded number of steps
                    if not x.m.prefetch(sid):
                        break
                    x.sync()
                    _step(x, disk)
                else:
                    x.m.give_up_prefetch(sid)
                hit = x.m.match_prefix(sid)
                assert hit <= _computed_hit(done, salt, prompt), (seed, i, hit)
                assert x.m.allocate_slots(sid, len(prompt) - hit) is not None
                x.m.start(sid)
                x.m.finish(sid, "stop")
                for n in range(BS, len(prompt) + 1, BS):
                    done.add((salt, tuple(prompt[:n])))
                x.sync()
            elif op < 0.7 and disk.files:
                disk.bad_files.add(rng.choice(sorted(disk.files)))  # corrupt a file
            elif op < 0.78:
                disk.fail_writes.add(rng.randrange(-(2**63), 2**63))  # no match: harmless
                if disk.files:  # a write of a hash that is stored again will fail
                    disk.fail_writes.add(rng.choice(sorted(disk.files)))
            elif op < 0.9:
                # a restart: graceful (persist) or not; the directory is what survives
                if rng.random() < 0.5:
                    x.m.persist_to_disk()
                    _step(x, disk)
                disk.saved, disk.loads = [], []
                _tally(seen, x)
                media |= x.media
                seen["restart"] = seen.get("restart", 0) + 1
                x = fresh()
                # a quick scan reads heads only: a flipped payload is found, then
                # fails its checksum when read (a miss)
                x.m.adopt_disk(disk.found())
                x.sync()
            _step(x, disk)
            indexed = {e[0] for e in x.m.disk.disk.entry if e is not None}
            pending = {x.m.disk.disk.entry[s][0] for s in x.m.disk.pending}
            assert indexed - pending <= set(disk.files) | disk.fail_writes, (seed, i)
        _tally(seen, x)
        media |= x.media
    assert media >= {"GPU", "CPU", "STORAGE"}
    for what in ("disk_store", "prefetch", "disk_load", "host_hit", "missed", "restart",
                 "adopted"):
        assert seen.get(what, 0) > 0, (what, seen)


def _tally(seen: dict[str, int], x: Mirrored) -> None:
    for e in x.events:
        seen[e["kind"]] = seen.get(e["kind"], 0) + 1
        if e["kind"] == "disk_load" and e.get("missed"):
            seen["missed"] = seen.get("missed", 0) + 1
        if e["kind"] == "store" and e.get("tier") == "disk":
            seen["adopted"] = seen.get("adopted", 0) + 1
