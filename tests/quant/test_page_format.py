"""kvscope.engine.runner.page_format: bytes per block (scales included), the pool from a budget,
allocation, and start-up checks of what a device can run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvscope.engine.runner.page_format import check_supported, page_format

SMOLLM2 = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)


def _fmt(name, model_dtype=torch.float16, block_size=16):
    return page_format(name, model_dtype, SMOLLM2, block_size)


def test_bytes_per_block_counts_codes_and_scales():
    per_token_head = {n: _fmt(n).bytes_per_token_head for n in ("auto", "fp8", "int8", "int4")}
    assert per_token_head == {"auto": 128, "fp8": 64, "int8": 64 + 2, "int4": 32 + 4}
    assert _fmt("auto", torch.float32).bytes_per_token_head == 256
    assert _fmt("int8").bytes_per_block == 2 * 30 * 16 * 3 * 66


def test_capacity_in_one_budget_meets_the_targets_against_fp16_pages():
    budget = 1 << 30
    base = _fmt("auto").num_blocks(budget)
    ratio = {n: _fmt(n).num_blocks(budget) / base for n in ("fp8", "int8", "int4")}
    assert ratio["fp8"] >= 1.9 and ratio["int8"] >= 1.9 and ratio["int4"] >= 3.5
    for n in ("auto", "fp8", "int8", "int4"):
        f = _fmt(n)
        assert f.num_blocks(budget) * f.bytes_per_block <= budget
        assert (f.num_blocks(budget) + 1) * f.bytes_per_block > budget


@pytest.mark.parametrize("name,dtype,scale_tail", [
    ("auto", torch.float16, None), ("fp8", torch.float8_e4m3fn, (3,)),
    ("int8", torch.int8, (5, 16, 3, 1)), ("int4", torch.uint8, (5, 16, 3, 2))])
def test_allocate_shapes_and_the_tensors_a_swap_must_move(name, dtype, scale_tail):
    small = SimpleNamespace(num_layers=2, num_kv_heads=3, head_dim=64)
    kv = page_format(name, torch.float16, small, 16).allocate(5, torch.device("cpu"))
    width = 32 if name == "int4" else 64
    assert [tuple(t.shape) for t in kv.k_caches] == [(5, 16, 3, width)] * 2
    assert all(t.dtype == dtype for t in (*kv.k_caches, *kv.v_caches))
    if scale_tail is None:
        assert kv.k_scales is None and len(kv.per_block_tensors) == 4
    else:
        assert [tuple(t.shape) for t in kv.k_scales] == [scale_tail] * 2
        moved = 8 if name in ("int8", "int4") else 4  # fp8 scales are per layer
        assert len(kv.per_block_tensors) == moved
    assert page_format(name, torch.float16, small, 16).name == (
        "fp16" if name == "auto" else name)


def test_bad_formats_are_start_up_errors():
    with pytest.raises(ValueError, match="unknown KV page format"):
        _fmt("int3")
    with pytest.raises(ValueError, match="even"):
        page_format("int4", torch.float32, SimpleNamespace(num_layers=1, num_kv_heads=1,
                                                           head_dim=7), 16)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        check_supported("fp4", torch.device("cpu"))
    for name in ("auto", "fp8", "int8", "int4"):
        check_supported(name, torch.device("cpu"))  # this machine runs all of them


def test_fp8_on_a_gpu_without_e4m3_support_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability >= 8.9"):
        check_supported("fp8", torch.device("cuda"))
    check_supported("int8", torch.device("cuda"))  # int8 needs nothing special
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_supported("fp8", torch.device("cuda"))


def test_fp8_without_torch_float8_is_refused(monkeypatch):
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        check_supported("fp8", torch.device("cpu"))
