"""Which system prompt lives in which slot of the KV store, and who is using it.

A prompt's life: `register` gives it a free slot in state "filling" (its KV is not computed yet);
whoever computes the KV calls `mark_ready`; requests `acquire` it while they run and `release` it
when they finish; `unregister` frees the slot once nobody holds it. A prompt that is filling or
held cannot be changed or removed: its slot's KV is being written, or read by running requests.
`drain` removes a ready prompt at once for new requests while its running ones finish: it keeps
its slot, in state "draining", until the last of them releases it, and its name is free at once
(a new registration of that name gets another slot, so the two never share KV).

The engine core's input thread (routing new requests) and its busy loop (filling slots, finishing
requests) call in from different threads, so every method takes one lock. No vLLM or torch here.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from vllm_relay.config import check_prompt_name, check_token_ids

if TYPE_CHECKING:
    from vllm_relay.config import RelayConfig

PromptState = Literal["filling", "ready", "draining"]


@dataclass(slots=True, eq=False)
class SystemPrompt:
    """One registered system prompt.

    The registry hands out its own live record: `state` and `refcount` are current when read.
    Only the registry writes them (under its lock); treat every field as read-only. Identity
    matters: re-registering a name with other tokens makes a new record, so `registry.get(name)
    is prompt` tells whether `prompt` is still the registration you matched against.
    """

    name: str
    slot: int
    token_ids: tuple[int, ...]
    state: PromptState = "filling"
    refcount: int = 0
    # Unique per registration (1, 2, ...): keys what was computed from this record, e.g. the
    # prefix-cache salt of its requests, which must change when a name gets new tokens.
    generation: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class SystemPromptRegistry:
    """Slots 0..max_prompts-1 of the system-prompt KV store, each empty or holding one prompt."""

    def __init__(self, max_prompts: int, max_prompt_tokens: int) -> None:
        if max_prompts < 1 or max_prompt_tokens < 1:
            raise ValueError(
                f"SystemPromptRegistry: max_prompts={max_prompts} and "
                f"max_prompt_tokens={max_prompt_tokens} must both be >= 1"
            )
        self.max_prompts = max_prompts
        self.max_prompt_tokens = max_prompt_tokens
        self._lock = threading.Lock()
        self._by_name: dict[str, SystemPrompt] = {}
        # Drained prompts still read by running requests: they keep their slots, not their names.
        self._draining: list[SystemPrompt] = []
        self._version = 0
        self._generations = 0

    @classmethod
    def from_config(cls, config: RelayConfig) -> SystemPromptRegistry:
        """An empty registry sized by `config` (its start-up prompts need tokenizing first)."""
        return cls(config.max_prompts, config.max_prompt_tokens)

    @property
    def version(self) -> int:
        """Bumped on every change to which prompts exist or their state.

        Refcounts do not bump it: they do not change what a request matches, and a matcher
        rebuilt on every acquire would cost O(total prompt tokens) per request.
        """
        return self._version

    # ---- reads -------------------------------------------------------------------------------

    def get(self, name: str) -> SystemPrompt | None:
        with self._lock:
            return self._by_name.get(name)

    def prompts(self) -> list[SystemPrompt]:
        """Every prompt holding a slot (filling, ready or draining), by slot."""
        with self._lock:
            return sorted([*self._by_name.values(), *self._draining], key=lambda p: p.slot)

    def ready_prompts(self) -> list[SystemPrompt]:
        """The prompts whose KV is computed, by slot: the ones requests may be routed to."""
        return self.ready_snapshot()[1]

    def ready_snapshot(self) -> tuple[int, list[SystemPrompt]]:
        """(version, ready prompts by slot), read together so a cache keyed by the version
        never pairs one version with another version's prompts."""
        return self.snapshot("ready")

    def snapshot(self, state: PromptState) -> tuple[int, list[SystemPrompt]]:
        """(version, prompts in `state` by slot), read together like `ready_snapshot`."""
        with self._lock:
            chosen = [p for p in self._by_name.values() if p.state == state]
            return self._version, sorted(chosen, key=lambda p: p.slot)

    def owns_slot(self, prompt: SystemPrompt) -> bool:
        """Whether `prompt` (this very record) still holds its slot, so its KV must be kept:
        it is the registration of its name, or it is draining (requests still read it)."""
        with self._lock:
            return self._by_name.get(prompt.name) is prompt or any(p is prompt for p in self._draining)

    def free_slots(self) -> list[int]:
        with self._lock:
            return self._free_slots()

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_name)

    def __contains__(self, name: object) -> bool:
        with self._lock:
            return name in self._by_name

    # ---- changes -----------------------------------------------------------------------------

    def register(self, name: str, token_ids: Sequence[int]) -> SystemPrompt:
        """Give `name` a slot, in state "filling"; return its record.

        Registering the same tokens again returns the existing record unchanged (so start-up
        and API retries are idempotent). Other tokens under a registered name replace it in the
        same slot, back to "filling", but only while nobody holds it and it is not filling.
        """
        check_prompt_name(name)
        ids = tuple(check_token_ids(f"system prompt {name!r}", token_ids, self.max_prompt_tokens))
        with self._lock:
            old = self._by_name.get(name)
            if old is not None:
                if old.token_ids == ids:
                    return old
                self._check_idle(old, "re-register it with different tokens")
                slot = old.slot
            else:
                free = self._free_slots()
                if not free:
                    raise ValueError(
                        f"cannot register system prompt {name!r}: no free slot, all "
                        f"max_prompts={self.max_prompts} are taken by {self._names()}; "
                        f"unregister one first"
                    )
                slot = free[0]
            self._generations += 1
            prompt = SystemPrompt(name=name, slot=slot, token_ids=ids, generation=self._generations)
            self._by_name[name] = prompt
            self._version += 1
            return prompt

    def mark_ready(self, name: str) -> SystemPrompt:
        """Record that `name`'s KV is computed; requests may now be routed to it. Idempotent."""
        with self._lock:
            prompt = self._lookup(name)
            if prompt.state != "ready":
                prompt.state = "ready"
                self._version += 1
            return prompt

    def abort_fill(self, name: str) -> None:
        """Drop a prompt that is still filling (its KV computation failed), freeing its slot.

        `unregister` refuses filling prompts so that a slot being written cannot be handed to
        another prompt; this is the filler's own way out.
        """
        with self._lock:
            prompt = self._lookup(name)
            if prompt.state != "filling":
                raise ValueError(
                    f"cannot abort filling system prompt {name!r}: it is {prompt.state}; "
                    f"use unregister"
                )
            del self._by_name[name]
            self._version += 1

    def unregister(self, name: str) -> None:
        """Remove `name` and free its slot; refused while it is held or filling."""
        with self._lock:
            self._check_idle(self._lookup(name), "unregister it")
            del self._by_name[name]
            self._version += 1

    def drain(self, name: str) -> SystemPrompt:
        """Stop routing to `name` at once; free its slot when its last request releases it.

        Returns the record, in state "draining" while requests still hold it. The name is free
        for a new registration at once; that one gets another slot. A filling prompt is refused
        (its slot is being written): abort its fill instead.
        """
        with self._lock:
            prompt = self._lookup(name)
            if prompt.state == "filling":
                raise ValueError(
                    f"cannot drain system prompt {name!r}: it is filling (its KV is being computed "
                    f"into slot {prompt.slot}); abort its fill instead"
                )
            del self._by_name[name]
            prompt.state = "draining"
            if prompt.refcount > 0:
                self._draining.append(prompt)
            self._version += 1
            return prompt

    def acquire(self, name: str) -> SystemPrompt:
        """Count one more request using `name`; it must be ready. Pair with `release`."""
        with self._lock:
            prompt = self._lookup(name)
            if prompt.state != "ready":
                raise ValueError(
                    f"cannot acquire system prompt {name!r}: it is {prompt.state}, not ready"
                )
            prompt.refcount += 1
            return prompt

    def try_acquire(self, prompt: SystemPrompt) -> bool:
        """Acquire `prompt` if it is still the ready registration of its name, else do nothing.

        For callers that matched against an older snapshot: between the match and the acquire
        the name may have been unregistered or re-registered with other tokens, and then the
        request's suffix, cut at the old length, would be wrong.
        """
        with self._lock:
            if self._by_name.get(prompt.name) is not prompt or prompt.state != "ready":
                return False
            prompt.refcount += 1
            return True

    def release(self, prompt: SystemPrompt | str) -> SystemPrompt:
        """Count one request fewer using `prompt` (a record, or the name of a registered one).

        Pass the record a request acquired: after a `drain` its name may belong to another
        registration. The last release of a draining prompt frees its slot.
        """
        with self._lock:
            if isinstance(prompt, str):
                prompt = self._lookup(prompt)
            if prompt.refcount <= 0:
                raise ValueError(
                    f"cannot release system prompt {prompt.name!r}: refcount is {prompt.refcount}, "
                    f"more releases than acquires"
                )
            prompt.refcount -= 1
            if prompt.refcount == 0 and prompt.state == "draining":
                self._draining.remove(prompt)
                self._version += 1
            return prompt

    # ---- helpers (caller holds the lock) -----------------------------------------------------

    def _lookup(self, name: str) -> SystemPrompt:
        prompt = self._by_name.get(name)
        if prompt is None:
            raise ValueError(f"no system prompt named {name!r}; registered: {self._names()}")
        return prompt

    def _check_idle(self, prompt: SystemPrompt, action: str) -> None:
        if prompt.state == "filling":
            raise ValueError(
                f"cannot {action}: system prompt {prompt.name!r} is filling (its KV is being "
                f"computed into slot {prompt.slot})"
            )
        if prompt.refcount > 0:
            raise ValueError(
                f"cannot {action}: system prompt {prompt.name!r} is held by "
                f"{prompt.refcount} request(s)"
            )

    def _free_slots(self) -> list[int]:
        taken = {p.slot for p in (*self._by_name.values(), *self._draining)}
        return [s for s in range(self.max_prompts) if s not in taken]

    def _names(self) -> list[str]:
        held = sorted([*self._by_name.values(), *self._draining], key=lambda p: p.slot)
        return [p.name + (" (draining)" if p.state == "draining" else "") for p in held]
