"""Real clients against a real daemon (issue 19): each client runs unmodified, offline,
against ``kvscope serve`` on the embedded model. Their tokenizer (lm-eval, guidellm load
one through transformers) is written once per session from the GGUF itself, with
SmolLM2's own pre-tokenizer (see tests/model/conftest.py::hf_tokenizer), so no client
downloads anything."""

from __future__ import annotations

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
    """A transformers tokenizer directory of the embedded model, built from its GGUF."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    from engine.model.pull import resolve_model

    gguf = resolve_model(MODEL_NAME)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    out = tmp_path_factory.mktemp("hf_tokenizer")
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="package")
def daemon() -> Iterator[Daemon]:
    d = start_daemon("--num-gpu-blocks", "256", "--max-model-len", "2048",
                     "--max-num-seqs", "16", "--served-model-name", MODEL_NAME)
    yield d
    stop_daemon(d)
