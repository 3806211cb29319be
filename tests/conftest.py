"""Shared test configuration. Area-specific fixtures live in tests/<area>/conftest.py."""

import gc
import os

import pytest


def _cuda_device_present() -> bool:
    """Whether this machine has an NVIDIA GPU, without importing torch (the torch-free test
    areas stay torch-free): the driver's device nodes."""
    return os.path.exists("/dev/nvidiactl") or os.path.isdir("/proc/driver/nvidia")


# Without a GPU the Triton kernels run under Triton's interpreter, which must be switched on
# before anything imports triton (Triton decorates its own library at import time). Set here,
# before any test module is imported, because much more than the kernel tests imports triton:
# importing transformers' model code imports torch._dynamo, which imports triton. In every
# pytest process (xdist workers too), so the kernel tests work in any order.
if not _cuda_device_present():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _qt_garbage_freed_on_the_main_thread(request: pytest.FixtureRequest):  # noqa: ANN201
    """A test that built Qt objects collects its cycles before the next test starts: left
    for later, a later test's worker thread could trip the collection and destroy a Qt
    widget off the GUI thread (inspector/gui_gc.py says what that does)."""
    yield
    if "qapp" in request.fixturenames:
        from kvscope.inspector import gui_gc

        if gui_gc.installed():  # the test ran the GUI as `kvscope inspect` does
            gui_gc.uninstall()  # collects here, then restores automatic collection
        else:
            gc.collect()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip, with the reason, where no CUDA device is visible (torch is
    imported only when such a test was collected: the torch-free areas stay torch-free)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (runs on the device: scripts/gpu_check.py)")
    for item in gpu_items:
        item.add_marker(skip)
