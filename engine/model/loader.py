"""The model side's entry point: a model argument ("smollm2", a .gguf file, an HF directory,
a ``dummy:`` preset, a ``stand-in:`` model) becomes (model, Tokenizer | None, ModelConfig);
``read_config`` and ``load_tokenizer`` read the config or the tokenizer alone, without
weights."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvscope.engine.model.architectures import model_class
from kvscope.engine.model.config import ModelConfig
from kvscope.engine.model.errors import ModelLoadError
from kvscope.engine.model.llama import LlamaModel
from kvscope.engine.model.pull import resolve_model
from kvscope.engine.model.tokenizer import Tokenizer


def _kind(path: Path) -> str:
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: directory has no config.json (not an HF model dir)")
        return "hf"
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf"
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic) and not a model directory")
    raise ModelLoadError(f"{path}: no such model file or directory")


def read_config(name_or_path: str | os.PathLike) -> tuple[Path, ModelConfig]:
    """The resolved path and config, without loading weights (``dummy:`` names: the
    preset's name as the path)."""
    from kvscope.engine.model.dummy import dummy_config, is_dummy
    from kvscope.engine.model.stand_in import is_stand_in, stand_in_target

    if is_dummy(name_or_path):
        return Path(str(name_or_path)), dummy_config(str(name_or_path))
    if is_stand_in(name_or_path):
        return read_config(stand_in_target(str(name_or_path)))
    path = resolve_model(name_or_path)
    if _kind(path) == "hf":
        from kvscope.engine.model.hf_loader import hf_config

        return path, hf_config(path)
    from kvscope.engine.model.gguf_loader import gguf_config, open_gguf

    return path, gguf_config(open_gguf(path), path)


def load_model(name_or_path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, *, seed: int = 0,
               hf_config: dict | None = None
               ) -> tuple[LlamaModel, Tokenizer | None, ModelConfig]:
    """Load weights (dequantized/cast to `dtype`) onto `device`, and the tokenizer.

    The tokenizer is None for an HF directory without tokenizer.json (e.g. a random test
    model) and for ``dummy:`` models (engine.model.dummy: random weights drawn from ``seed``;
    ``hf_config`` replaces the named config). Every bad input raises ModelLoadError naming
    the file and, where relevant, tensor.
    """
    from kvscope.engine.model.dummy import is_dummy, load_dummy
    from kvscope.engine.model.stand_in import is_stand_in, stand_in_for, stand_in_target

    if is_dummy(name_or_path):
        return load_dummy(str(name_or_path), device, dtype, seed, hf_config)
    if is_stand_in(name_or_path):  # no weights: a forward that sleeps (engine.model.stand_in)
        target = stand_in_target(str(name_or_path))
        _, config = read_config(target)
        tokenizer = load_tokenizer(target)
        return stand_in_for(config, tokenizer), tokenizer, config
    path = resolve_model(name_or_path)
    if _kind(path) == "hf":
        from kvscope.engine.model.hf_loader import hf_config, hf_tensors

        config = hf_config(path)
        model = model_class(config).from_tensors(config, hf_tensors(path, dtype), str(path),
                                                 device)
        tokenizer = None
        if (path / "tokenizer.json").is_file():
            tokenizer = Tokenizer.from_dir(path, config.eos_token_ids)
        return model, tokenizer, config

    from kvscope.engine.model.gguf_loader import (
        gguf_config,
        gguf_tensors,
        gguf_tokenizer_metadata,
        open_gguf,
    )

    reader = open_gguf(path)
    config = gguf_config(reader, path)
    tokenizer = Tokenizer.from_gguf_metadata(gguf_tokenizer_metadata(reader, path), str(path))
    model = model_class(config).from_tensors(config, gguf_tensors(reader, path, config, dtype),
                                             str(path), device)
    return model, tokenizer, config


def load_tokenizer(name_or_path: str | os.PathLike) -> Tokenizer | None:
    """The model's tokenizer only (a GGUF's metadata or an HF dir's tokenizer.json), no
    weights; None when the model has none (an HF dir without tokenizer.json, ``dummy:``)."""
    from kvscope.engine.model.dummy import is_dummy
    from kvscope.engine.model.stand_in import is_stand_in, stand_in_target

    if is_dummy(name_or_path):
        return None
    if is_stand_in(name_or_path):
        return load_tokenizer(stand_in_target(str(name_or_path)))
    path = resolve_model(name_or_path)
    if _kind(path) == "hf":
        from kvscope.engine.model.hf_loader import hf_config

        if not (path / "tokenizer.json").is_file():
            return None
        return Tokenizer.from_dir(path, hf_config(path).eos_token_ids)
    from kvscope.engine.model.gguf_loader import gguf_tokenizer_metadata, open_gguf

    return Tokenizer.from_gguf_metadata(gguf_tokenizer_metadata(open_gguf(path), path),
                                        str(path))
