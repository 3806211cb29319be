"""Session fixtures for the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF): ours and
transformers', both loaded once per test session from the same file."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """Run this package's tests with one intra-op thread, restoring the setting afterwards.

    Measured on the shared 2-core dev box under load (load average ~7): a SmolLM2 decode step
    took 1.72 s with torch's default 2 threads (every op waits a scheduler slice at the OpenMP
    barrier for a descheduled thread) and 0.18 s with 1 thread.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_path():
    from kvscope.engine.model.pull import resolve_model

    return resolve_model("smollm2")  # downloads once into $KVSCOPE_HOME


@pytest.fixture(scope="session")
def llm(smollm2_path):
    """The LLM facade on the default model, float32 on CPU (loaded once per session)."""
    from kvscope.engine import LLM

    return LLM(str(smollm2_path), device="cpu", dtype="float32", seed=0)


@pytest.fixture(scope="session")
def smollm2(llm):
    """(model, tokenizer, config) in float32 on CPU: the same objects the `llm` fixture holds."""
    return llm.model, llm.tokenizer, llm.config


@pytest.fixture(scope="session")
def hf_tokenizer_stock(smollm2_path):
    """transformers' tokenizer exactly as its GGUF converter builds it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def hf_tokenizer(hf_tokenizer_stock):
    """transformers' tokenizer for the GGUF with SmolLM2's own pre-tokenizer restored.

    The GGUF says `tokenizer.ggml.pre = "smollm"`; llama.cpp (and SmolLM2's tokenizer.json)
    split every digit apart before GPT-2's regex, but transformers' converter does not know
    "smollm" and falls back to plain GPT-2 splitting, which differs on whitespace before a
    digit ("x   0"). See test_tokenizer.py::test_stock_transformers_gguf_digit_divergence.
    """
    import copy

    from tokenizers import pre_tokenizers

    tok = copy.deepcopy(hf_tokenizer_stock)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    return tok


@pytest.fixture(scope="session")
def hf_model(smollm2_path):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                 dtype=torch.float32)
    return model.eval()
