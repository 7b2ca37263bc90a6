"""Let `--attention-backend relay` take effect on vLLM's CPU platform.

`CpuPlatform.get_attn_backend_cls` ignores the requested backend and always returns CPU_ATTN.
We wrap it: when the requested backend is `CUSTOM` and `CUSTOM` resolves to this plugin (which
is what `relay` selects), return the relay CPU backend after the same validation the CUDA
platform applies; every other request goes to the original method unchanged.
"""

from vllm_relay import RELAY_BACKEND, RELAY_CPU_BACKEND
from vllm_relay.hooks._patch import original, patch


def _relay_requested(selected_backend) -> bool:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return selected_backend == AttentionBackendEnum.CUSTOM and (
        AttentionBackendEnum.CUSTOM.get_path() == RELAY_BACKEND
    )


def _get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
    if not _relay_requested(selected_backend):
        return original(CpuPlatform, "get_attn_backend_cls").__func__(
            cls, selected_backend, attn_selector_config, num_heads
        )
    from vllm.utils.import_utils import resolve_obj_by_qualname

    backend_cls = resolve_obj_by_qualname(RELAY_CPU_BACKEND)
    reasons = backend_cls.validate_configuration(
        device_capability=None, **attn_selector_config._asdict()
    )
    if reasons:
        raise ValueError(
            f"The relay attention backend does not support this configuration on CPU: "
            f"{'; '.join(reasons)}."
        )
    return RELAY_CPU_BACKEND


CpuPlatform = None


def apply() -> None:
    global CpuPlatform
    from vllm.platforms.cpu import CpuPlatform as _CpuPlatform

    CpuPlatform = _CpuPlatform
    patch(CpuPlatform, "get_attn_backend_cls", classmethod(_get_attn_backend_cls))
