"""A prompt's block hashes computed once for the requests that repeat it (the n samples of one prompt).

vLLM fans `SamplingParams(n=...)` out into n requests with the same prompt, and its engine core
hashes every full block of each one's prompt for the prefix cache: a sha256 per block, 1000 of
them for a 16K-token prompt, some milliseconds per request on the host, paid n times, and before
the scheduler sees the request. The same prompt sent by several clients at once pays the same.

A block's hash depends only on the tokens up to its end and on the request's extra keys: its cache
salt (first block), LoRA adapter, multimodal inputs and prompt embeddings. So a request whose
prompt tokens and salt equal those of a request hashed a moment before, with no adapter, no
multimodal input and no embeddings, gets a copy of that request's hashes: exactly what vLLM's
hasher would compute (tested against it). Everything else, and every later call for a request
(blocks filled by generated tokens), goes to vLLM's hasher unchanged.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable


class PromptHashMemo:
    """Wraps vLLM's request block hasher (`EngineCore.request_block_hasher`) with an LRU of the
    last `size` prompts' hashes. Thread-safe: vLLM hashes in the engine core's input thread."""

    def __init__(self, hasher: Callable[[Any], list], size: int = 16) -> None:
        self.hasher = hasher
        self.size = size
        self.hits = 0
        self._memo: OrderedDict[tuple, list] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, request) -> list:
        if request.block_hashes or not _memoizable(request):
            return self.hasher(request)
        key = (request.cache_salt, tuple(request.prompt_token_ids))
        with self._lock:
            hashes = self._memo.get(key)
            if hashes is not None:
                self._memo.move_to_end(key)
                self.hits += 1
                return list(hashes)
        hashes = self.hasher(request)
        if hashes:
            with self._lock:
                self._memo[key] = hashes
                if len(self._memo) > self.size:
                    self._memo.popitem(last=False)
        return list(hashes)


def _memoizable(request) -> bool:
    """A new request (no output yet) whose hashes its prompt tokens and salt alone determine."""
    return (request.prompt_token_ids is not None and request.prompt_embeds is None
            and request.lora_request is None and not request.mm_features
            and request.num_tokens == request.num_prompt_tokens)
