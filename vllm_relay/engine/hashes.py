"""A prompt's block hashes computed once for the requests that repeat it or begin with it: the n
samples of one prompt, the same prompt sent by several clients, questions over one long document.

vLLM's engine core hashes every full block of each new request's prompt for the prefix cache: a
sha256 per block, 1000 of them for a 16K-token prompt, about 6 ms per request on the host, before
the scheduler sees the request. vLLM fans `SamplingParams(n=...)` out into n requests with the same
prompt and pays it n times; requests over one document pay it for the whole document each time.

A block's hash is chained: it depends only on the tokens up to the block's end and on the request's
extra keys (its cache salt, in the first block; its LoRA adapter, multimodal inputs and prompt
embeddings, in every block). So for a request with no adapter, no multimodal input and no
embeddings, the hashes of the whole blocks its prompt shares with a prompt hashed a moment before
under the same salt are that prompt's hashes; vLLM's hasher computes the rest, chained from them:
exactly what it would compute alone (tested against it). Everything else, and every later call for
a request (blocks filled by generated tokens), goes to vLLM's hasher unchanged.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass
class _Prompt:
    salt: str | None
    tokens: list  # the prompt's tokens in whole blocks (a copy: the memo never sees later changes)
    hashes: list  # their block hashes
    array: np.ndarray | None = None  # the tokens as an array, made when first compared past a block

    def as_array(self) -> np.ndarray:
        if self.array is None:
            self.array = _array(self.tokens, len(self.tokens))
        return self.array


class PromptHashMemo:
    """Wraps vLLM's request block hasher (`EngineCore.request_block_hasher`, over blocks of
    `block_size` tokens) with the last `size` prompts' tokens and hashes, most recent last.
    Thread-safe: vLLM hashes in the engine core's input thread."""

    def __init__(self, hasher: Callable[[Any], list], block_size: int, size: int = 16) -> None:
        self.hasher = hasher
        self.block_size = block_size
        self.size = size
        self.hits = 0  # prompts whose every block hash was reused
        self.reused_blocks = 0  # block hashes not computed again
        self._prompts: list[_Prompt] = []
        self._lock = threading.Lock()

    def __call__(self, request) -> list:
        if request.block_hashes or not _memoizable(request):
            return self.hasher(request)
        tokens, salt, bs = request.prompt_token_ids, request.cache_salt, self.block_size
        full = len(tokens) // bs
        if full == 0:
            return self.hasher(request)
        with self._lock:
            best, shared, array = self._longest(tokens, salt, full)
            reused = best.hashes[:shared] if best is not None else []
            if shared == full:  # every block: the prompt is that one, or begins it
                self._prompts.remove(best)
                self._prompts.append(best)
                self.hits += 1
            self.reused_blocks += shared
        if shared == full:
            return reused
        request.block_hashes.extend(reused)  # vLLM's hasher chains from the last of them
        try:
            hashes = reused + self.hasher(request)
        finally:
            del request.block_hashes[:]  # the caller adds what this returns
        with self._lock:
            self._prompts.append(_Prompt(salt, tokens[: full * bs], hashes, array))
            del self._prompts[: -self.size]
        return list(hashes)

    def _longest(self, tokens: list, salt, full: int) -> tuple[_Prompt | None, int, np.ndarray | None]:
        """The remembered prompt under `salt` that begins with the most of `tokens`' `full` whole
        blocks, how many, and `tokens` as an array (made only when some prompt shares the first)."""
        bs = self.block_size
        first = tokens[:bs]
        alike = [p for p in reversed(self._prompts) if p.salt == salt and p.tokens[:bs] == first]
        if not alike:
            return None, 0, None
        whole = tokens if len(tokens) == full * bs else tokens[: full * bs]
        m = len(whole)
        last = whole[m - bs:]
        for prompt in alike:  # the same prompt again (the n samples of one): its last block, then all
            seen = prompt.tokens
            if len(seen) >= m and seen[m - bs: m] == last and (seen if len(seen) == m else seen[:m]) == whole:
                return prompt, full, None
        array = _array(tokens, full * bs)
        best, shared = None, 0
        for prompt in alike:
            span = slice(shared * bs, (shared + 1) * bs)
            if shared and prompt.tokens[span] != tokens[span]:
                continue  # it parts from `tokens` by block `shared`: it cannot share more
            k = common_blocks(array, prompt.as_array(), bs)
            if k > shared:
                best, shared = prompt, k
                if k == full:
                    break
        return best, shared, array


def common_blocks(a: np.ndarray, b: np.ndarray, block_size: int) -> int:
    """How many whole blocks of `block_size` tokens `a` and `b` begin with alike."""
    n = min(a.shape[0], b.shape[0]) // block_size * block_size
    differ = a[:n] != b[:n]
    first = int(differ.argmax()) if n else 0
    return first // block_size if n and differ[first] else n // block_size


def _array(tokens: list, n: int) -> np.ndarray:
    return np.fromiter(tokens, dtype=np.int64, count=n)


def _memoizable(request) -> bool:
    """A new request (no output yet) whose hashes its prompt tokens and salt alone determine."""
    return (isinstance(request.prompt_token_ids, list) and request.prompt_embeds is None
            and request.lora_request is None and not request.mm_features
            and request.num_tokens == request.num_prompt_tokens)
