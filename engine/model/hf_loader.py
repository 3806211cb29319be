"""Read a Hugging Face model directory: config.json plus *.safetensors (one file, or shards
listed by model.safetensors.index.json). Errors become ModelLoadError naming the file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from kvscope.engine.model.config import ModelConfig, config_from_hf
from kvscope.engine.model.errors import ModelLoadError


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{path}: missing") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: not readable JSON ({exc})") from exc


def hf_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    return config_from_hf(_read_json(path), str(path))


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a directory, in a stable order."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: lacks a 'weight_map' object")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: shard listed in {index.name} is missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files")
    return files


def hf_tensors(model_dir: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor in `dtype`) for every tensor in the directory's weight files."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name).to(dtype)
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors raises SafetensorError, OSError...
            raise ModelLoadError(f"{path}: not a readable safetensors file ({exc})") from exc
