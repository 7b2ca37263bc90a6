"""The paged-KV blocks that hold each filled system prompt, kept out of the scheduler's pool.

A fill is an ordinary request: the scheduler gives it blocks of the paged KV cache and the model
writes the prompt's keys and values there. When it finishes, instead of letting those blocks go
back to the pool, the engine core keeps the prompt's whole blocks (one more reference each, as a
prefix-cache hit takes), and the workers read them as the prompt's pages. They go back to the
pool when the prompt no longer owns its slot. Only whole blocks are kept: a relay request strips
`relay_len` tokens (the prompt rounded down to a block) and computes the rest itself. With an EAGLE-style
drafter (`lookahead` 1) the rounding starts one token earlier and the fill computes one token more: the
drafter's KV of a token comes from the next one, which must then be the prompt's, not a request's.
"""

from __future__ import annotations

from typing import Any

from vllm_relay.system_prompts import SystemPrompt, SystemPromptRegistry


class PromptPages:
    def __init__(self, scheduler: Any, block_size: int, lookahead: int = 0) -> None:
        self._scheduler = scheduler
        self.block_size = block_size
        self.lookahead = lookahead  # validate.drafter_lookahead
        self._kept: dict[SystemPrompt, list[Any]] = {}  # prompt record -> its KVCacheBlocks

    def relay_len(self, prompt: SystemPrompt) -> int:
        """Tokens of `prompt` that relay requests read from its pages: whole blocks only, followed by
        at least `lookahead` tokens of the prompt."""
        n = prompt.num_tokens - self.lookahead
        return n - n % self.block_size

    def fill_len(self, prompt: SystemPrompt) -> int:
        """Tokens of `prompt` its fill computes: the relay length and the lookahead."""
        return self.relay_len(prompt) + self.lookahead

    def keep(self, prompt: SystemPrompt, fill_request_id: str) -> int:
        """Keep the whole blocks of a fill that has just finished (before the scheduler frees
        the request's blocks), in every KV-cache group: of a sliding-window group, those the
        scheduler has not already let go (the window before the prompt's end is all its layers
        read). Returns how many."""
        kvm = self._scheduler.kv_cache_manager
        n = self.relay_len(prompt) // self.block_size
        blocks = [b for group in kvm.get_blocks(fill_request_id).blocks for b in group[:n] if not b.is_null]
        kvm.block_pool.touch(blocks)
        old = self._kept.pop(prompt, None)
        if old is not None:  # a prompt is filled once; never leak if it happened twice
            kvm.block_pool.free_blocks(old)
        self._kept[prompt] = blocks
        return len(blocks)

    def sweep(self, registry: SystemPromptRegistry) -> None:
        """Give back the blocks of every prompt that no longer owns its slot."""
        gone = [p for p in self._kept if not registry.owns_slot(p)]
        for prompt in gone:
            self._scheduler.kv_cache_manager.block_pool.free_blocks(self._kept.pop(prompt))

    def release_all(self) -> None:
        """Give back every prompt's blocks (their KV is about to be stale: engine/refills.py)."""
        pool = self._scheduler.kv_cache_manager.block_pool
        for blocks in self._kept.values():
            pool.free_blocks(blocks)
        self._kept.clear()

    def num_blocks(self) -> int:
        return sum(len(b) for b in self._kept.values())
