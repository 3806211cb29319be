"""Which install extra a missing module belongs to, for the CLI's error message.

``pip install kvscope`` is the light half (events, recordings, the vLLM plugin, the load
generator: no Qt, no torch); ``kvscope[inspector]`` adds Qt; ``kvscope[engine]`` adds
torch and the model stack; ``kvscope[gpu]`` adds triton."""

from __future__ import annotations

EXTRA_OF_MODULE = {
    "torch": "engine", "gguf": "engine", "safetensors": "engine", "tokenizers": "engine",
    "jinja2": "engine", "tqdm": "engine", "fastapi": "engine", "uvicorn": "engine",
    "matplotlib": "engine", "starlette": "engine", "triton": "gpu",
    "PySide6": "inspector", "pyqtgraph": "inspector", "shiboken6": "inspector",
}


def missing_extra_message(command: str, err: ModuleNotFoundError) -> str | None:
    """A one-line hint when ``err`` is a module of a known extra, else None."""
    top = (err.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    if extra is None:
        return None
    return (f"kvscope {command}: needs the '{extra}' extra (module {top!r} is not "
            f"installed): pip install 'kvscope[{extra}]'")
