"""Which forward runs a config: Gemma 3's own, else the Llama family's."""

from __future__ import annotations

from kvscope.engine.model.config import ModelConfig
from kvscope.engine.model.llama import LlamaModel


def model_class(config: ModelConfig) -> type[LlamaModel]:
    if config.architecture == "gemma3_text":
        from kvscope.engine.model.gemma3 import Gemma3Model

        return Gemma3Model
    return LlamaModel
