"""Every change this plugin makes to vLLM at run time. Each one is listed in patches/README.md."""

from vllm_relay.hooks._patch import applied_patches, revert_all  # noqa: F401


def apply_all() -> None:
    """Apply every patch; idempotent (vLLM loads plugins several times per process).

    Each patched function checks `protocol.relay_enabled(vllm_config)` first and otherwise behaves
    exactly as the original, so an engine that did not ask for relay is untouched.
    """
    from vllm_relay.hooks import engine, platform, runner

    platform.apply()
    runner.apply()
    engine.apply()
