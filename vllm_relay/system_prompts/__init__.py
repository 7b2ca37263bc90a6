"""System prompts: which ones the KV store holds (registry) and which one a request uses (routing).

Pure Python, importable without vLLM or torch, so the engine core can route requests cheaply.
"""

from vllm_relay.system_prompts.registry import PromptState, SystemPrompt, SystemPromptRegistry
from vllm_relay.system_prompts.routing import PrefixMatcher, Routed, match_filling, matcher_for, route

__all__ = [
    "PrefixMatcher",
    "PromptState",
    "Routed",
    "SystemPrompt",
    "SystemPromptRegistry",
    "match_filling",
    "matcher_for",
    "route",
]
