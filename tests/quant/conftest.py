"""Engine-level quant tests share one loaded default model (read-only during generation)."""

from __future__ import annotations

import pytest
import torch

from kvscope.engine.model import load_model


@pytest.fixture(scope="session")
def loaded():
    torch.set_num_threads(2)
    return load_model("smollm2", device="cpu", dtype=torch.float32)
