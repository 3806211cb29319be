"""kvscope's engine. `from engine import LLM, SamplingParams, StructuredOutputsParams` is
the offline API.

Exports are lazy (module __getattr__) so that `import engine.events` never imports torch."""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from engine.sampling import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from engine.structured import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
