"""kvscope's engine. `from kvscope.engine import LLM, SamplingParams, StructuredOutputsParams` is
the offline API.

Exports are lazy (module __getattr__) so that `import kvscope.engine.events` never imports torch."""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvscope.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvscope.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from kvscope.engine.structured import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
