"""The engine core's relay state: routing decisions, holds, fills, salts and counters.

Domain logic, not patches: `RelayEngine` is attached to vLLM's EngineCore by the thin forwarding
patches of `vllm_relay.hooks.engine`, and imports nothing from them.
"""

from vllm_relay.engine.core import RelayEngine

__all__ = ["RelayEngine"]
