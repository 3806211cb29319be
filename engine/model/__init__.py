"""The model side: loaders (GGUF, HF directory, ``dummy:`` and ``stand-in:`` names), the
Llama-family forward, the tokenizer.

`from engine.model import load_model` is the entry point; exports are lazy so importing the
package costs nothing until one is used."""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "load_model": "kvscope.engine.model.loader",
    "read_config": "kvscope.engine.model.loader",
    "load_tokenizer": "kvscope.engine.model.loader",
    "resolve_model": "kvscope.engine.model.pull",
    "ModelConfig": "kvscope.engine.model.config",
    "ModelLoadError": "kvscope.engine.model.errors",
    "LlamaModel": "kvscope.engine.model.llama",
    "Tokenizer": "kvscope.engine.model.tokenizer",
    "AttentionBackend": "kvscope.engine.model.attention",
    "ContiguousKVCache": "kvscope.engine.model.contiguous_cache",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvscope.engine.model' has no attribute {name!r}")
