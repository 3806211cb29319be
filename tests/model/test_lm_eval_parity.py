"""lm-eval (EleutherAI's harness), unmodified, through its ``local-completions`` model
against the daemon: a small multiple-choice task (loglikelihoods via echo + logprobs)
and a generate_until task, shipped with the tests and read from local files (no
downloads, HF offline). The per-item loglikelihoods must equal those lm-eval computes
with transformers' own model (its ``hf`` model, given this package's session
``hf_model``: loading it again would cost ~40 s) on the same GGUF and tokenizer, and so
must the accuracy. Lives in tests/model for that shared fixture."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.conftest import Daemon, start_daemon, stop_daemon

pytestmark = pytest.mark.slow

MODEL_NAME = "smollm2"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

DATA = Path(__file__).parent / "lm_eval_data"
TOLERANCE = 5e-3  # nats per item (a sum over a few tokens; logits agree within 1e-3)

MC_TASK = """\
task: kvscope_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GEN_TASK = """\
task: kvscope_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    before = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)  # lm-eval's datasets must read the local files only
    d = start_daemon("--num-gpu-blocks", "128", "--max-model-len", "256",
                     "--served-model-name", MODEL_NAME)
    yield d
    stop_daemon(d)
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def hf_tokenizer_dir(hf_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tokenizer as a directory, which lm-eval's local-completions loads by path."""
    out = tmp_path_factory.mktemp("hf_tokenizer")
    hf_tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory: pytest.TempPathFactory):
    from lm_eval.tasks import TaskManager

    tasks = tmp_path_factory.mktemp("lm_eval_tasks")
    (tasks / "kvscope_mc.yaml").write_text(MC_TASK.format(data=DATA))
    (tasks / "kvscope_gen.yaml").write_text(GEN_TASK.format(data=DATA))
    return TaskManager(include_path=str(tasks), include_defaults=False)


def _logliks(results: dict, task: str) -> list[list[float]]:
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [[resp[0] for resp in s["filtered_resps"]] for s in samples]


def test_lm_eval_local_completions_matches_transformers(daemon: Daemon, hf_tokenizer_dir,
                                                        hf_model, hf_tokenizer, task_manager):
    import lm_eval

    ours = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": MODEL_NAME, "base_url": daemon.url + "/v1/completions",
                    "tokenizer": str(hf_tokenizer_dir), "tokenizer_backend": "huggingface",
                    "num_concurrent": 4, "max_retries": 1, "timeout": 120},
        tasks=["kvscope_mc", "kvscope_gen"], task_manager=task_manager, log_samples=True,
        batch_size=1)
    from lm_eval.models.huggingface import HFLM

    theirs = lm_eval.simple_evaluate(
        model=HFLM(pretrained=hf_model, tokenizer=hf_tokenizer, batch_size=4),
        tasks=["kvscope_mc"], task_manager=task_manager, log_samples=True)

    got, want = _logliks(ours, "kvscope_mc"), _logliks(theirs, "kvscope_mc")
    assert len(got) == len(want) == 16
    for g, w in zip(got, want, strict=True):
        assert all(math.isfinite(x) and x < 0 for x in g)
        assert max(abs(a - b) for a, b in zip(g, w, strict=True)) < TOLERANCE, (g, w)
    acc = ours["results"]["kvscope_mc"]["acc,none"]
    gap = max(abs(a - b) for g, w in zip(got, want, strict=True)
              for a, b in zip(g, w, strict=True))
    print(f"lm-eval kvscope_mc: acc {acc:.4f} via kvscope, "  # shown with pytest -s
          f"{theirs['results']['kvscope_mc']['acc,none']:.4f} via transformers; "
          f"max per-item loglikelihood gap {gap:.2e} nats")
    assert acc == theirs["results"]["kvscope_mc"]["acc,none"]
    assert acc > 0.5  # the model knows most of these; all-0.0 logprobs would give 0.25

    gen = sorted(ours["samples"]["kvscope_gen"], key=lambda s: s["doc_id"])
    assert len(gen) == 4 and all(isinstance(s["filtered_resps"][0], str) for s in gen)
    assert any(s["filtered_resps"][0].strip() for s in gen)
