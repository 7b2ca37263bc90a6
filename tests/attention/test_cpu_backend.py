"""The CPU backend's torch levels read vLLM's own CPU KV cache: its cache writes store K transposed
per block ([D, block_size]) and V plainly; `torch_views` must read back exactly what was written."""

import pytest
import torch

from vllm.platforms import current_platform  # noqa: E402

# The CPU kernels as vLLM itself loads them: the build for this machine's ISA (`vllm._C` is the
# AVX-512 BF16 build; importing it directly on an AVX2-only CPU kills the process).
current_platform.import_kernels()
if not hasattr(torch.ops._C, "cpu_attn_reshape_and_cache"):
    pytest.skip("vLLM's CPU kernels are not built for this machine", allow_module_level=True)
from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from vllm_relay.attention.cpu_backend import torch_views, torch_views_match  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("block_size, head_size", [(16, 64), (32, 128), (48, 80)])
def test_views_read_what_vllms_cache_writes_store(dtype, block_size, head_size):
    isa = _get_attn_isa(dtype, block_size, head_size, "auto")
    assert torch_views_match(isa, dtype, block_size, head_size)
    g = torch.Generator().manual_seed(block_size + head_size)
    nb, h = 7, 3
    kv = torch.zeros(nb, h, block_size, 2 * head_size, dtype=dtype)
    key_cache, value_cache = kv.view(nb, h, 2 * block_size, head_size).chunk(2, dim=2)
    slots = torch.randperm(nb * block_size, generator=g)[: 2 * block_size + 5]  # scattered, partial blocks
    key = torch.randn(slots.shape[0], h, head_size, generator=g).to(dtype)
    value = torch.randn(slots.shape[0], h, head_size, generator=g).to(dtype)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")
    k, v = torch_views(key_cache, value_cache)
    assert k.shape == v.shape == (nb, block_size, h, head_size)
    assert torch.equal(k.flatten(0, 1)[slots], key) and torch.equal(v.flatten(0, 1)[slots], value)


@pytest.mark.parametrize("kv_cache_dtype, fp8", [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
@pytest.mark.parametrize("block_size, head_size", [(32, 64), (64, 128)])
def test_fp8_views_read_what_vllms_cache_writes_store(kv_cache_dtype, fp8, block_size, head_size):
    """An FP8 cache: vLLM stores value / scale on the FP8 grid; the views, read as FP8 times the scale,
    give back the values written, to the grid's step (random values at random slots)."""
    try:
        isa = _get_attn_isa(torch.float32, block_size, head_size, kv_cache_dtype)
    except NotImplementedError as e:  # no AVX-512 / AMX: vLLM's CPU backend has no FP8 cache here
        pytest.skip(str(e))
    assert torch_views_match(isa, torch.float32, block_size, head_size, kv_cache_dtype)
    g = torch.Generator().manual_seed(head_size)
    nb, h, k_scale, v_scale = 5, 2, 0.3, 1.7
    kv = torch.zeros(nb, h, block_size, 2 * head_size, dtype=torch.uint8)
    key_cache, value_cache = kv.view(nb, h, 2 * block_size, head_size).chunk(2, dim=2)
    slots = torch.randperm(nb * block_size, generator=g)[: block_size + 3]
    key = torch.randn(slots.shape[0], h, head_size, generator=g)
    value = torch.randn(slots.shape[0], h, head_size, generator=g)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, k_scale=k_scale,
                                   v_scale=v_scale, kv_cache_dtype=kv_cache_dtype)
    k, v = (x.view(fp8) for x in torch_views(key_cache, value_cache))
    got_k = k.flatten(0, 1)[slots].float() * k_scale
    got_v = v.flatten(0, 1)[slots].float() * v_scale
    # Within one step of the FP8 grid (relative 2^-3 for e4m3, 2^-2 for e5m2) of the values written:
    # vLLM's CPU write does not always round to the nearest (seen: 0.11 relative with e4m3).
    rtol = 2.0 ** -3 if fp8 is torch.float8_e4m3fn else 2.0 ** -2
    torch.testing.assert_close(got_k, key, rtol=rtol, atol=k_scale * 2.0 ** -9)
    torch.testing.assert_close(got_v, value, rtol=rtol, atol=v_scale * 2.0 ** -9)
    assert not torch.equal(got_k, key)  # the values went through the FP8 grid (not a float32 copy)
