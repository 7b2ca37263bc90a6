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
