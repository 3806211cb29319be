"""``kvscope serve`` with two faults injected, for the fault-isolation tests:

- a request seeded with ``POISON_SEED`` raises inside the engine step's sampling (a
  per-request fault: only that request may fail);
- a batch holding token id ``KILLER_TOKEN`` raises in the model runner (an engine fault,
  as a kernel error would: the daemon must exit non-zero).

Run as ``python -m tests.server.faulty_serve serve ...`` (the arguments of engine.cli).
"""

from __future__ import annotations

import sys

POISON_SEED = 1337
KILLER_TOKEN = 4242


def _inject() -> None:
    import kvscope.engine.sampler as sampler_module
    from kvscope.engine.runner.model_runner import ModelRunner

    real_sample, real_sample_batch = sampler_module.sample, sampler_module.sample_batch
    real_execute = ModelRunner.execute_keeping

    def sample(logits, params, *rest, **kw):  # noqa: ANN001, ANN202
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("injected per-request fault")
        return real_sample(logits, params, *rest, **kw)

    def sample_batch(logits, params, *rest, **kw):  # noqa: ANN001, ANN202
        # the batch fails with the poisoned row in it; the engine then samples row by row
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("injected per-request fault")
        return real_sample_batch(logits, params, *rest, **kw)

    def execute_keeping(self, batch, rows):  # noqa: ANN001, ANN202
        if bool((batch.input_ids == KILLER_TOKEN).any()):
            raise RuntimeError("injected engine fault (as a kernel error)")
        return real_execute(self, batch, rows)

    sampler_module.sample = sample
    sampler_module.sample_batch = sample_batch
    ModelRunner.execute_keeping = execute_keeping


if __name__ == "__main__":
    _inject()
    from kvscope.engine.cli import main

    sys.exit(main())
