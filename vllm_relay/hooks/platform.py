"""Let `--attention-backend relay` take effect on vLLM's CPU platform, and for MLA layers on CUDA.

`CpuPlatform.get_attn_backend_cls` ignores the requested backend and always returns CPU_ATTN.
We wrap it: when the requested backend is `CUSTOM` and `CUSTOM` resolves to this plugin (which
is what `relay` selects), return the relay CPU backend after the same validation the CUDA
platform applies; every other request goes to the original method unchanged.

On CUDA one backend class serves a selected name, and relay's (FlashAttention's) cannot run MLA's
latent layers: for those (`use_mla`), `CudaPlatformBase.get_attn_backend_cls` returns relay's MLA
backend (FLASH_ATTN_MLA's, extended) after its own validation; every other call, vLLM's method.
"""

from vllm_relay import RELAY_BACKEND, RELAY_CPU_BACKEND, RELAY_MLA_BACKEND
from vllm_relay.hooks._patch import original, patch


def _relay_requested(selected_backend) -> bool:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return selected_backend == AttentionBackendEnum.CUSTOM and (
        AttentionBackendEnum.CUSTOM.get_path() == RELAY_BACKEND
    )


def _validated(path: str, device_capability, attn_selector_config, where: str) -> str:
    """`path` (a relay backend class's), after its own validation against the layer's configuration,
    as vLLM's CUDA platform validates a selected backend: a `ValueError` with its reasons."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    reasons = resolve_obj_by_qualname(path).validate_configuration(
        device_capability=device_capability, **attn_selector_config._asdict()
    )
    if reasons:
        raise ValueError(f"The relay attention backend does not support this {where}: {'; '.join(reasons)}.")
    return path


def _get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
    if not _relay_requested(selected_backend):
        return original(CpuPlatform, "get_attn_backend_cls").__func__(
            cls, selected_backend, attn_selector_config, num_heads
        )
    return _validated(RELAY_CPU_BACKEND, None, attn_selector_config, "configuration on CPU")


def _get_cuda_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
    if not (_relay_requested(selected_backend) and attn_selector_config.use_mla):
        return original(CudaPlatformBase, "get_attn_backend_cls").__func__(
            cls, selected_backend, attn_selector_config, num_heads
        )
    return _validated(RELAY_MLA_BACKEND, cls.get_device_capability(), attn_selector_config,
                      "MLA configuration (it extends FLASH_ATTN_MLA)")


CpuPlatform = None
CudaPlatformBase = None


def apply() -> None:
    global CpuPlatform, CudaPlatformBase
    from vllm.platforms import current_platform
    from vllm.platforms.cpu import CpuPlatform as _CpuPlatform

    CpuPlatform = _CpuPlatform
    patch(CpuPlatform, "get_attn_backend_cls", classmethod(_get_attn_backend_cls))
    if current_platform.is_cuda():  # (vLLM's CUDA platform module needs its CUDA build to import)
        from vllm.platforms.cuda import CudaPlatformBase as _CudaPlatformBase

        CudaPlatformBase = _CudaPlatformBase
        patch(CudaPlatformBase, "get_attn_backend_cls", classmethod(_get_cuda_attn_backend_cls))
