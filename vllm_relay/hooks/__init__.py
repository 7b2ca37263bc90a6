"""Every change this plugin makes to vLLM at run time. Each one is listed in patches/README.md."""

from vllm_relay.hooks._patch import applied_patches, revert_all  # noqa: F401


def apply_all() -> None:
    """Apply every patch; idempotent (vLLM loads plugins several times per process).

    Each patched function behaves exactly as the original unless relay is enabled for that engine
    (`protocol.relay_enabled`, or a RelayEngine attached to the engine core); the
    spawned engine core's entry point only loads plugins first when the CUSTOM backend is selected.
    """
    from vllm_relay.hooks import capture_sizes, detokenizer, engine, frontend, platform, transport

    platform.apply()
    capture_sizes.apply()
    engine.apply()
    frontend.apply()
    detokenizer.apply()
    transport.apply()
