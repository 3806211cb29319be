"""Shared test configuration. Area-specific fixtures live in tests/<area>/conftest.py."""


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip, with the reason, where no CUDA device is visible (torch is
    imported only when such a test was collected: the torch-free areas stay torch-free)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the device: scripts/gpu_check.py)")
    for item in gpu_items:
        item.add_marker(skip)
