"""Real clients against a real daemon (issue 19): each client runs unmodified, offline,
against ``kvscope serve`` on the embedded model, and against ``kvscope route`` in front of
it (``target``: the router must pass everything through unchanged). (lm-eval lives in
tests/model/test_lm_eval_parity.py, beside the transformers model it compares with.)
guidellm loads a tokenizer through transformers: one is written once per session from
the GGUF itself, so no client downloads anything."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import Daemon, start_daemon, stop_daemon

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1"}
MODEL_NAME = "smollm2"


@pytest.fixture(scope="package", autouse=True)
def offline() -> Iterator[None]:
    before = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)
    yield
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="package")
def hf_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A transformers tokenizer directory of the embedded model: kvscope's own tokenizer
    (built from the GGUF's metadata, SmolLM2's pre-tokenizer included) saved as
    tokenizer.json, which transformers loads as a PreTrainedTokenizerFast. (Converting
    the GGUF with transformers costs ~40 s here and gets the digit split wrong.)"""
    from kvscope.engine.model.gguf_loader import gguf_tokenizer_metadata, open_gguf
    from kvscope.engine.model.pull import resolve_model
    from kvscope.engine.model.tokenizer import Tokenizer

    gguf = resolve_model(MODEL_NAME)
    tok = Tokenizer.from_gguf_metadata(gguf_tokenizer_metadata(open_gguf(gguf), gguf),
                                       str(gguf))
    out = tmp_path_factory.mktemp("hf_tokenizer")
    tok.backend.save(str(out / "tokenizer.json"))

    def text(token_id: int | None) -> str | None:
        return None if token_id is None else tok.token_text(token_id)

    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192,
        "bos_token": text(tok.bos_token_id), "eos_token": text(tok.eos_token_ids[0]),
        "add_bos_token": tok.add_bos}))
    return out


@pytest.fixture(scope="package")
def daemon() -> Iterator[Daemon]:
    # A short context and n <= 2 bound what any valid request can cost, so a fuzzer's
    # random valid bodies (schemathesis) stay cheap; guidellm's 32 + 8 tokens fit.
    d = start_daemon("--num-gpu-blocks", "64", "--max-model-len", "96", "--max-n", "2",
                     "--max-num-seqs", "8", "--served-model-name", MODEL_NAME)
    yield d
    stop_daemon(d)


@pytest.fixture(scope="package")
def router(daemon: Daemon) -> Iterator[str]:
    """``kvscope route`` with the daemon as its one replica; its URL."""
    import sys

    from tests.router.conftest import launch, wait_ready

    p = wait_ready(*launch([sys.executable, "-m", "kvscope.engine.cli", "route", "--port", "0",
                            "--replica", daemon.url]))
    yield p.url
    p.stop()


@pytest.fixture(scope="package", params=["daemon", "router"])
def target(request: pytest.FixtureRequest, daemon: Daemon) -> str:
    """The URL a client is pointed at: the daemon itself, or the router in front of it."""
    return daemon.url if request.param == "daemon" else request.getfixturevalue("router")
