"""kvscope.engine.model.linear: the load-time choice of linear (oneDNN packed on CPU, F.linear
otherwise) computes what F.linear computes, for every batch size including 0."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvscope.engine.model.linear import ENV_VAR, DenseLinear, PackedCpuLinear, make_linear


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, tol, bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype) if bias else None
    lin = make_linear(w, b)
    if torch.backends.mkldnn.is_available():
        assert isinstance(lin, PackedCpuLinear)
    for m in (0, 1, 7, 64):
        x = torch.randn(m, 40, generator=g).to(dtype)
        got, want = lin(x), F.linear(x, w, b)
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_unsupported_dtype_and_the_dense_switch_use_f_linear(monkeypatch):
    assert isinstance(make_linear(torch.ones(4, 4, dtype=torch.float16)), DenseLinear)
    monkeypatch.setenv(ENV_VAR, "dense")
    assert isinstance(make_linear(torch.ones(4, 4)), DenseLinear)
    monkeypatch.setenv(ENV_VAR, "fastest")
    with pytest.raises(ValueError, match=ENV_VAR):
        make_linear(torch.ones(4, 4))


def test_non_contiguous_input():
    w = torch.randn(8, 6)
    x = torch.randn(6, 5).t()  # [5, 6], strided
    torch.testing.assert_close(make_linear(w)(x), F.linear(x, w))
