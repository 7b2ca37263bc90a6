"""vllm-relay: RelayAttention for vLLM.

A service's system prompt is the same for every request; RelayAttention reads its KV cache once
per decode step for the whole batch instead of once per request. This package is a vLLM plugin:
vLLM calls `register()` in every process (front end, engine core, workers) through the
`vllm.general_plugins` entry point.
"""

__version__ = "0.1.0"

# Dotted paths, so that registering imports nothing heavy.
RELAY_BACKEND = "vllm_relay.attention.backend.RelayAttentionBackend"
RELAY_CPU_BACKEND = "vllm_relay.attention.cpu_backend.RelayCPUBackend"
RELAY_MLA_BACKEND = "vllm_relay.attention.mla_backend.RelayMLABackend"  # MLA layers on CUDA (hooks/platform.py)


def register() -> None:
    """Make `--attention-backend relay` (any case) select the relay backend.

    Re-entrant and cheap: vLLM calls it several times per process. It touches no device.

    vLLM has no spawn-safe API to add a backend name (0.33's `AttentionBackendEnum.register`
    takes a string but is lost in spawned processes), and a new enum member would not survive
    pickling into spawned workers (they unpickle the config before any plugin loads). So
    `RELAY` becomes an alias of the existing `CUSTOM` member, whose class path we override;
    the selected member pickles as `CUSTOM` and resolves to us again in every process.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    AttentionBackendEnum._member_map_.setdefault("RELAY", AttentionBackendEnum.CUSTOM)
    register_backend(AttentionBackendEnum.CUSTOM, RELAY_BACKEND)

    from vllm_relay.hooks import apply_all

    apply_all()
