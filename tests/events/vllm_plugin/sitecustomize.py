"""Test-only, in vLLM's venv (on PYTHONPATH for tests/events/test_vllm_plugin.py): when
KVSCOPE_TEST_EXPECT names a file, every process that has vLLM's scheduler writes, at each
point where the kvscope plugin closes a batch, vLLM's own state (read here, independently
of the plugin's reader) as one JSON line. Patched at interpreter start, so the plugin
(loaded later, in EngineCore.__init__) wraps these: its batch is closed right after the
state written here, with nothing of vLLM's running in between."""

import os

if os.environ.get("KVSCOPE_TEST_EXPECT"):
    from vllm_expect import install

    install(os.environ["KVSCOPE_TEST_EXPECT"])
