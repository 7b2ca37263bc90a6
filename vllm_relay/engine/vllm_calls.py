"""vLLM's own EngineCore methods, as they were before the hooks patched them.

A leaf module: the RelayEngine (engine/core.py) and its fills (engine/fills.py) call vLLM's
`preprocess_add_request` and `add_request` through it, without importing each other.
"""

from __future__ import annotations

from vllm_relay.hooks._patch import original


def vllm_method(name: str):
    """vLLM's own (unpatched) EngineCore method `name`."""
    from vllm.v1.engine.core import EngineCore

    return original(EngineCore, name)
