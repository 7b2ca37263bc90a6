"""Every change this plugin makes to vLLM at run time. Each one is listed in patches/README.md."""

from vllm_relay.hooks._patch import applied_patches, revert_all  # noqa: F401


def apply_all() -> None:
    """Apply every patch; idempotent (vLLM loads plugins several times per process)."""
    from vllm_relay.hooks import platform

    platform.apply()
