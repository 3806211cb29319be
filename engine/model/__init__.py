"""The model side: loaders (GGUF, HF directory, ``dummy:`` and ``stand-in:`` names), the
Llama-family forward, the tokenizer.

`from engine.model import load_model` is the entry point; exports are lazy so importing the
package costs nothing until one is used."""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "load_model": "engine.model.loader",
    "read_config": "engine.model.loader",
    "load_tokenizer": "engine.model.loader",
    "resolve_model": "engine.model.pull",
    "ModelConfig": "engine.model.config",
    "ModelLoadError": "engine.model.errors",
    "LlamaModel": "engine.model.llama",
    "Tokenizer": "engine.model.tokenizer",
    "AttentionBackend": "engine.model.attention",
    "ContiguousKVCache": "engine.model.contiguous_cache",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'engine.model' has no attribute {name!r}")
