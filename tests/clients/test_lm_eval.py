"""lm-eval (EleutherAI's harness), unmodified, through its ``local-completions`` model
against the daemon: a small multiple-choice task (loglikelihoods via echo + logprobs)
and a generate_until task, shipped with the tests and read from local files (no
downloads). The per-item loglikelihoods must equal those lm-eval computes with
transformers' own model (``hf``) on the same GGUF and tokenizer, and so must the
accuracy."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from engine.model.pull import resolve_model
from tests.clients.conftest import MODEL_NAME
from tests.server.conftest import Daemon

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
                                                        task_manager):
    import lm_eval

    ours = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": MODEL_NAME, "base_url": daemon.url + "/v1/completions",
                    "tokenizer": str(hf_tokenizer_dir), "tokenizer_backend": "huggingface",
                    "num_concurrent": 4, "max_retries": 1, "timeout": 120},
        tasks=["kvscope_mc", "kvscope_gen"], task_manager=task_manager, log_samples=True,
        batch_size=1)
    gguf = resolve_model(MODEL_NAME)
    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(gguf.parent), "gguf_file": gguf.name,
                    "tokenizer": str(hf_tokenizer_dir), "dtype": "float32",
                    "device": "cpu"},
        tasks=["kvscope_mc"], task_manager=task_manager, log_samples=True, batch_size=4)

    got, want = _logliks(ours, "kvscope_mc"), _logliks(theirs, "kvscope_mc")
    assert len(got) == len(want) == 16
    for g, w in zip(got, want, strict=True):
        assert all(math.isfinite(x) and x < 0 for x in g)
        assert max(abs(a - b) for a, b in zip(g, w, strict=True)) < TOLERANCE, (g, w)
    acc = ours["results"]["kvscope_mc"]["acc,none"]
    assert acc == theirs["results"]["kvscope_mc"]["acc,none"]
    assert acc > 0.5  # the model knows most of these; all-0.0 logprobs would give 0.25

    gen = sorted(ours["samples"]["kvscope_gen"], key=lambda s: s["doc_id"])
    assert len(gen) == 4 and all(isinstance(s["filtered_resps"][0], str) for s in gen)
    assert any(s["filtered_resps"][0].strip() for s in gen)
