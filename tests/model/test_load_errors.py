"""Every bad model input raises ModelLoadError with a message naming the file (and tensor)."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from kvscope.engine.model.errors import ModelLoadError
from kvscope.engine.model.loader import load_model, read_config
from tests.model.tiny_models import save_hf, tiny_hf_model, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_llama():
    return tiny_hf_model("llama")


def test_wrong_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such model file or directory") as err:
        load_model(tmp_path / "nope.gguf")
    assert "nope.gguf" in str(err.value)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"this is not a model" * 10)
    with pytest.raises(ModelLoadError, match="junk.gguf: not a GGUF file"):
        load_model(path)


def test_corrupt_gguf_header(tmp_path, tiny_llama):
    good = write_tiny_gguf(tiny_llama, tmp_path / "good.gguf").read_bytes()
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(good[:8] + b"\xff" * 16 + good[24:])  # magic kept, counts garbled
    with pytest.raises(ModelLoadError, match="corrupt.gguf"):
        load_model(path)


def test_truncated_gguf(tmp_path, tiny_llama):
    good = write_tiny_gguf(tiny_llama, tmp_path / "good.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(good[: len(good) * 2 // 3])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        load_model(path)


def test_unsupported_gguf_architecture(tmp_path, tiny_llama):
    path = write_tiny_gguf(tiny_llama, tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ModelLoadError, match="gpt2.gguf: unsupported architecture 'gpt2'"):
        load_model(path)


def test_gguf_missing_tensor(tmp_path, tiny_llama):
    path = write_tiny_gguf(tiny_llama, tmp_path / "m.gguf", drop=("blk.1.ffn_down.weight",))
    with pytest.raises(ModelLoadError,
                       match=r"m.gguf: missing tensor 'model.layers.1.mlp.down_proj.weight'"):
        load_model(path)


def test_gguf_longrope_without_its_short_factors(tmp_path):
    rotary = 16  # head_dim 64 / 4: every dim rotated, one factor per pair
    rope = {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0] * (rotary // 2), "long_factor": [2.0] * (rotary // 2)}
    hf = tiny_hf_model("phi3", original_max_position_embeddings=128, rope_parameters=rope,
                       num_hidden_layers=1)
    path = write_tiny_gguf(hf, tmp_path / "phi.gguf", arch="phi3",
                           drop=("rope_factors_short.weight",))
    with pytest.raises(ModelLoadError, match=r"phi.gguf: LongRoPE needs tensor "
                                             r"'rope_factors_short.weight'"):
        load_model(path)


def test_hf_unsupported_architecture(tmp_path, tiny_llama):
    save_hf(tiny_llama, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"model_type": "gpt_neox"}))
    with pytest.raises(ModelLoadError, match=r"config.json: unsupported architecture 'gpt_neox'"):
        load_model(tmp_path)


def test_hf_shape_mismatch(tmp_path, tiny_llama):
    save_hf(tiny_llama, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.weight"
    weights[name] = weights[name][:-1].contiguous()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=rf"{name}' has shape \(31, 64\), expected"):
        load_model(tmp_path)


def test_hf_missing_tensor(tmp_path, tiny_llama):
    save_hf(tiny_llama, tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r": missing tensor 'model\.norm\.weight'") as err:
        load_model(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_hf_directory_without_weights_or_config(tmp_path, tiny_llama):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
    save_hf(tiny_llama, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(tmp_path)


def test_corrupt_safetensors(tmp_path, tiny_llama):
    save_hf(tiny_llama, tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 100)
    with pytest.raises(ModelLoadError, match="model.safetensors: not a readable safetensors"):
        load_model(tmp_path)


def test_read_config_does_not_need_weights(tmp_path, tiny_llama):
    save_hf(tiny_llama, tmp_path)
    (tmp_path / "model.safetensors").unlink()
    _, config = read_config(tmp_path)
    assert config.num_layers == 2 and config.head_dim == 16
