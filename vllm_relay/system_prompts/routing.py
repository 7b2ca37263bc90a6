"""Route a request to the system prompt its token ids begin with.

A routed request goes to the engine with only its own tokens (positions shifted by the system
length S) and reads the system KV from the prompt's slot. The rule is the longest ready prompt
that is a proper prefix of the request: longest, because nested prompts (A a prefix of B) should
share as much precomputed KV as possible; proper, because the engine must compute at least one
token of the request itself.

Pure Python: this runs in the engine core (its input thread) for every request, before any tensor exists.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from vllm_relay.system_prompts.registry import PromptState, SystemPrompt, SystemPromptRegistry

# Tokens a routed request must keep for itself: the engine needs something to compute.
MIN_SUFFIX_TOKENS = 1
# Leading tokens that key the matcher's index. Prompts differ early in practice (a name or an
# instruction), so a short key already leaves about one candidate; it is cut to the shortest
# prompt's length so every prompt has a full key.
INDEX_KEY_TOKENS = 8
# Routing retries when the registry changes between matching and acquiring. Each retry means
# another thread changed the registry, so more than a few is pathological; giving up routes the
# request the ordinary way (full prompt), which is always correct.
MAX_ROUTE_ATTEMPTS = 4


class PrefixMatcher:
    """Longest-proper-prefix lookup over a fixed set of prompts; build once, match many times.

    The index maps the first `key_len` token ids to the prompts starting with them, longest
    first. A match slices the request once per candidate and compares at C speed, so it costs
    O(total prompt tokens) at worst and O(len(longest candidate)) usually, never a Python loop
    over tokens.
    """

    __slots__ = ("version", "key_len", "_index")

    def __init__(self, prompts: Iterable[SystemPrompt], version: int = -1) -> None:
        # Ties (equal token ids under two names) go to the lower slot, for determinism.
        ordered = sorted(prompts, key=lambda p: (-len(p.token_ids), p.slot))
        self.version = version
        self.key_len = min([INDEX_KEY_TOKENS, *(len(p.token_ids) for p in ordered)])
        index: dict[tuple[int, ...], list[tuple[list[int], SystemPrompt]]] = {}
        for p in ordered:
            # Lists, because requests arrive as lists and a list never equals a tuple.
            index.setdefault(p.token_ids[: self.key_len], []).append((list(p.token_ids), p))
        self._index = index

    @classmethod
    def from_registry(cls, registry: SystemPromptRegistry, state: PromptState = "ready") -> PrefixMatcher:
        version, prompts = registry.snapshot(state)
        return cls(prompts, version)

    def __len__(self) -> int:
        return sum(len(c) for c in self._index.values())

    def match(self, prompt_token_ids: Sequence[int]) -> SystemPrompt | None:
        """The longest prompt that is a prefix of `prompt_token_ids` and leaves the request
        at least MIN_SUFFIX_TOKENS of its own; None if there is none."""
        if not self._index:
            return None
        ids = prompt_token_ids if isinstance(prompt_token_ids, list) else list(prompt_token_ids)
        candidates = self._index.get(tuple(ids[: self.key_len]))
        if not candidates:
            return None
        longest_allowed = len(ids) - MIN_SUFFIX_TOKENS
        for tokens, prompt in candidates:  # longest first
            n = len(tokens)
            if n <= longest_allowed and ids[:n] == tokens:
                return prompt
        return None


@dataclass(frozen=True, slots=True)
class Routed:
    """A request split at its system prompt: the engine gets `suffix_token_ids` at positions
    `system_len`, `system_len + 1`, ..., and reads positions below `system_len` from the
    prompt's slot of the KV store."""

    prompt: SystemPrompt
    suffix_token_ids: list[int]
    system_len: int


# One matcher per live registry (and prompt state), replaced when its version moves on. Weak
# keys, so a registry dropped by its owner (tests make many) takes its matchers with it.
_matchers: weakref.WeakKeyDictionary[SystemPromptRegistry, PrefixMatcher] = (
    weakref.WeakKeyDictionary()
)
_filling_matchers: weakref.WeakKeyDictionary[SystemPromptRegistry, PrefixMatcher] = (
    weakref.WeakKeyDictionary()
)
_matchers_lock = threading.Lock()


def matcher_for(registry: SystemPromptRegistry, state: PromptState = "ready") -> PrefixMatcher:
    """The cached matcher over `registry`'s prompts in `state`, rebuilt if the version moved on."""
    cache = _matchers if state == "ready" else _filling_matchers
    with _matchers_lock:
        cached = cache.get(registry)
    if cached is not None and cached.version == registry.version:
        return cached
    # Built outside the lock: two threads may both build one; either result is right.
    if state == "ready":
        fresh = PrefixMatcher.from_registry(registry)
    else:
        fresh = PrefixMatcher.from_registry(registry, state)
    with _matchers_lock:
        current = cache.get(registry)
        if current is None or current.version < fresh.version:
            cache[registry] = fresh
    return fresh


def match_filling(
    prompt_token_ids: Sequence[int], registry: SystemPromptRegistry, *, longer_than: int = 0
) -> SystemPrompt | None:
    """The longest prompt still filling that is a proper prefix of the request and longer than
    `longer_than` tokens (the ready prompt it was routed to, if any); None if there is none.

    Such a request is worth holding until the fill completes rather than running it now with a
    shorter prompt or none. Advisory like `route(acquire=False)`: the fill may complete or fail
    before the caller acts on it, so the caller re-checks the prompt's state.
    """
    prompt = matcher_for(registry, "filling").match(prompt_token_ids)
    return prompt if prompt is not None and prompt.num_tokens > longer_than else None


def route(
    prompt_token_ids: Sequence[int], registry: SystemPromptRegistry, *, acquire: bool = False
) -> Routed | None:
    """Split a request at the longest ready system prompt it begins with; None if none fits.

    With `acquire=True` the prompt is also acquired, atomically with respect to registry
    changes (the caller must `registry.release(routed.prompt.name)` when the request finishes).
    Without it the result is advisory: the prompt may be unregistered before it is used.
    """
    for _ in range(MAX_ROUTE_ATTEMPTS):
        prompt = matcher_for(registry).match(prompt_token_ids)
        if prompt is None:
            return None
        if not acquire or registry.try_acquire(prompt):
            system_len = len(prompt.token_ids)
            return Routed(prompt, list(prompt_token_ids[system_len:]), system_len)
    return None
