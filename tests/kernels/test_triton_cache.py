"""Triton reshape_and_cache and copy_blocks against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kvscope import kernels
from kvscope.kernels import reference


def _caches(num_blocks, block_size, hkv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    return k, torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_reshape_and_cache_matches_reference_with_padding(cache_dtype, head_dim, device):
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, bs, hkv, t = 6, 8, 3, 13
    key = torch.randn(t, hkv, head_dim, generator=gen)  # fp32 tokens into fp16 pages too
    value = torch.randn(t, hkv, head_dim, generator=gen)
    slots = torch.randperm(num_blocks * bs, generator=gen)[:t]
    slots[[2, 7, 12]] = -1  # padding tokens
    want_k, want_v = _caches(num_blocks, bs, hkv, head_dim, cache_dtype)
    got_k, got_v = want_k.clone().to(device), want_v.clone().to(device)
    reference.reshape_and_cache(key, value, want_k, want_v, slots)
    with kernels.force_backend("triton"):
        kernels.reshape_and_cache(key.to(device), value.to(device), got_k, got_v,
                                  slots.to(device))
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)
    # and the reference wrote exactly the non-padding slots
    flat = want_k.flatten(0, 1)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat[slot], key[i].to(cache_dtype))


def test_reshape_and_cache_strided_cache_view(device):
    """A cache that is a view with padded head stride (not contiguous) is written in place."""
    storage = torch.zeros(4, 8, 2, 80, device=device)
    k_cache, v_cache = storage[..., :64], storage.clone()[..., :64]
    key = torch.randn(3, 2, 64, device=device)
    slots = torch.tensor([0, 9, 31], device=device)
    with kernels.force_backend("triton"):
        kernels.reshape_and_cache(key, key, k_cache, v_cache, slots)
    assert torch.equal(k_cache[1, 1], key[1]) and torch.equal(storage[3, 7, :, :64], key[2])
    assert storage[..., 64:].abs().sum() == 0  # nothing written into the padding columns


def test_triton_skips_out_of_range_slot_reference_raises(device):
    k_cache, v_cache = _caches(2, 4, 1, 64, torch.float32)
    before = k_cache.clone()
    key = torch.ones(2, 1, 64)
    bad = torch.tensor([1, 8])  # 8 == num_blocks * block_size: out of range
    with pytest.raises(ValueError, match="slot_mapping out of range"):
        reference.reshape_and_cache(key, key, k_cache, v_cache, bad)
    assert torch.equal(k_cache, before)  # the reference rejects before writing anything
    dev_k, dev_v = k_cache.to(device), v_cache.to(device)
    with kernels.force_backend("triton"):
        kernels.reshape_and_cache(key.to(device), key.to(device), dev_k, dev_v, bad.to(device))
    expected = before.clone()
    expected[0, 1] = 1.0
    assert torch.equal(dev_k.cpu(), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_copy_blocks_matches_reference(dtype, device):
    layers = 2
    caches = [_caches(7, 4, 3, 80, dtype, seed=i) for i in range(layers)]
    mapping = torch.tensor([[0, 5], [3, 1], [0, 6]])
    want_k = [k.clone() for k, _ in caches]
    want_v = [v.clone() for _, v in caches]
    reference.copy_blocks(want_k, want_v, mapping)
    got_k = [k.to(device) for k, _ in caches]
    got_v = [v.to(device) for _, v in caches]
    with kernels.force_backend("triton"):
        kernels.copy_blocks(got_k, got_v, mapping.to(device))
    for layer in range(layers):
        assert torch.equal(got_k[layer].cpu(), want_k[layer])
        assert torch.equal(got_v[layer].cpu(), want_v[layer])
        assert torch.equal(want_k[layer][5], caches[layer][0][0])
        assert torch.equal(want_v[layer][1], caches[layer][1][3])
        assert torch.equal(want_k[layer][2], caches[layer][0][2])  # untouched page


def test_copy_blocks_rejects_non_contiguous_pages(device):
    k = torch.zeros(4, 4, 2, 80, device=device)[..., :64]
    with kernels.force_backend("triton"), pytest.raises(ValueError, match="contiguous"):
        kernels.copy_blocks([k], [k.clone()], torch.tensor([[0, 1]], device=device))
