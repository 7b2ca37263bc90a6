"""A new request's prefix-cache lookup that starts from the blocks a recent lookup found for the same
prompt: the n samples of one prompt, the same prompt sent concurrently, questions over one document.

vLLM's scheduler looks every new request up in the prefix cache block by block
(`find_longest_cache_hit`): for each of the prompt's whole blocks it builds the block's cache key, finds
it in the cache map and appends the block, about 2 us a block on the host. A 4K-token prompt costs
0.25-0.5 ms a request, a 16K one 1-2 ms; vLLM fans `SamplingParams(n=...)` out into n requests and
pays it n times, in the steps that admit them, while the GPU waits. Its first-output bookkeeping
(`estimate_cached_tokens`) then walks every block of each request again.

The memo keeps the last lookups' hashes, cache keys and blocks. A new lookup takes the remembered
one that begins with the most of its hashes (list comparisons: the hashes of repeated prompts are
the same objects, `engine/hashes.py`), keeps those of its blocks that the cache map still returns
for their keys (one `dict.get` each, in C), exactly what vLLM's walk would return for them, and
leaves the rest of the prompt to vLLM's own lookup. It is installed only where that walk is the whole
of vLLM's lookup: one KV-cache group of full attention, hashes of whole blocks, no EAGLE block drop,
no context parallelism.

A whole-prompt hit. vLLM caps a lookup one token short of the request (its last token is computed
again for the logits), and its hits are whole blocks, so a request whose prompt is cached computes again
the tokens of its last block: up to 16 tokens of full forward for each of n samples, more than the
prompt itself for a 1K prompt with n=1024. Where the lookup is vLLM's default one, the memo looks the
request's every whole block up and, when all are cached, takes its last block too: the cached one if
the prompt is whole blocks, else the partly filled last block of a sibling (a live request with the same
tokens, no multimodal input, that computed them in an earlier step: the n samples of one prompt), and
reports all but the last token computed. vLLM 0.32+ takes such a sub-block hit as it takes any
(`SingleTypeKVCacheManager._partial_hit_reqs`): the request gets a private copy of that block (the
scheduler's `kv_cache_block_copies`, copied by the worker before the step's forward) and computes its
last token only, into that copy; its reported cached tokens are then all but one. Never from a block
this step's forward writes (the copy runs before it): a cached block must not have been cached in the
step being scheduled (vLLM's walk may hand a request such blocks, because a step writes every layer's
keys and values before it reads them), so the block pool's `cache_full_blocks` notes the blocks cached
in a step and the manager's `new_step_starts` forgets them; a sibling must have computed its tokens in
an earlier step (vLLM counts a request's computed tokens when it has scheduled the step).

A sibling admitted in the step that computes the prompt would so compute the last block's tokens
again (up to a block of full forward each: for n=1024 samples of a 1K prompt, 15 times the prompt).
It waits one step instead (`waits_for_sibling`, asked by relay's scheduler for each waiting request)
and then takes a whole-prompt hit: the group's first request computes the prompt alone, the others
their last token in the next step, at the cost of that one step to their first token. A request whose
last block holds one token to compute (nothing to save) does not wait.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_relay.hooks._patch import swap


# A request's siblings looked at for the partly filled block: the last few requests of its prompt that
# compute their own (a request that takes a sibling's is not kept: the siblings found stay).
SIBLINGS = 4


@dataclass
class _Hit:
    hashes: list  # the request's block hashes of the blocks found (a copy)
    blocks: list  # the KVCacheBlocks found
    keys: list | None = None  # their cache keys (the hashes with the group id), made when first reused


class CacheHitMemo:
    """Replaces `find_longest_cache_hit` of a `UnitaryKVCacheCoordinator` and `estimate_cached_tokens`
    (and, for whole-prompt hits, its `get_computed_blocks` and `new_step_starts`, and its block pool's
    `cache_full_blocks`; instance attributes: `install`), remembering the last `size` lookups."""

    def __init__(self, manager, size: int = 8) -> None:
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        coordinator = manager.coordinator
        self._find = coordinator.find_longest_cache_hit  # vLLM's, bound to the coordinator
        self._manager = coordinator.single_type_managers[0]  # its requests' blocks
        self._key = make_block_hash_with_group_id
        self._pool = coordinator.block_pool  # its cache map is read at each lookup: a reset replaces it
        self.block_size = coordinator.block_size
        self.size = size
        self.hits = 0  # lookups that reused a remembered block
        self.reused_blocks = 0  # blocks not looked up again
        self.whole_prompt_hits = 0  # requests handed all but their last token as computed
        self._hits: list[_Hit] = []  # most recent last
        self._get_computed_blocks = manager.get_computed_blocks  # vLLM's, bound to the manager
        self._new_step_starts = manager.new_step_starts
        self._cache_full_blocks = self._pool.cache_full_blocks
        self._request = None  # the request whose default lookup runs now
        self._took_tail = False  # and whether it took a sibling's partly filled block
        # The requests looked up so, by the hash of their last whole block (siblings of later ones):
        # the last `SIBLINGS` of each of the last `size` * 8 prompts; forgotten when the prefix cache is
        # reset (vLLM makes a new cache map, once no request holds a block: for new weights, say).
        self._recent: dict = {}
        self._recent_map = self._pool.cached_block_hash_to_block
        self._tails = not manager.enable_kv_cache_events  # (vLLM's events would describe a sibling's block)
        self._fresh: set[int] = set()  # ids of the blocks cached in the step being scheduled
        self._whole = False  # whole-prompt hits on (install)

    @classmethod
    def install(cls, manager, whole_prompts: bool = True) -> CacheHitMemo | None:
        """Wrap `manager` (the scheduler's `KVCacheManager`) where its lookup is the plain walk; with
        `whole_prompts`, a request whose prompt was computed computes its last token only (module
        docstring)."""
        if not applies(manager):
            return None
        memo = cls(manager)
        swap(manager.coordinator, "find_longest_cache_hit", memo.find_longest_cache_hit)
        swap(manager, "estimate_cached_tokens", memo.estimate_cached_tokens)
        if whole_prompts:
            swap(manager, "get_computed_blocks", memo.get_computed_blocks)
            swap(manager, "new_step_starts", memo.new_step_starts)
            swap(memo._pool, "cache_full_blocks", memo.cache_full_blocks)
            memo._whole = True
        return memo

    def new_step_starts(self) -> None:
        self._fresh.clear()
        self._new_step_starts()

    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs) -> None:
        self._fresh.update(b.block_id for b in blocks[num_cached_blocks:num_full_blocks])
        self._cache_full_blocks(request, blocks, num_cached_blocks, num_full_blocks, *args, **kwargs)

    def get_computed_blocks(self, request, *args, **kwargs):
        """vLLM's, whose lookup (`find_longest_cache_hit`, below) may then reach the request's last
        block: only for vLLM's default limit (none given; 0.33 passes one positionally or by name)."""
        limit = args[0] if args else kwargs.get("max_cache_hit_length")
        if limit is not None or request.num_tokens < self.block_size:
            return self._get_computed_blocks(request, *args, **kwargs)
        if self._recent_map is not self._pool.cached_block_hash_to_block:  # the prefix cache was reset
            self._recent, self._recent_map = {}, self._pool.cached_block_hash_to_block
        self._request, self._took_tail = request, False
        try:
            return self._get_computed_blocks(request, *args, **kwargs)
        finally:
            self._request = None
            if self._has_siblings(request) and not self._took_tail:  # it computes its own last block
                key = request.block_hashes[request.num_tokens // self.block_size - 1]
                siblings = self._recent.pop(key, [])
                siblings.append(request)
                self._recent[key] = siblings[-SIBLINGS:]  # (most recent prompt last)
                if len(self._recent) > 8 * self.size:
                    del self._recent[next(iter(self._recent))]

    def waits_for_sibling(self, request) -> bool:
        """Whether `request`, about to be looked up, should wait a step: a sibling (the same tokens) is
        scheduled in this step to its last token from before its last block, and so computes the blocks
        `request` would compute again; after the step `request` takes a whole-prompt hit. Only where it
        saves tokens: its last block holds two or more (a block for a prompt of whole blocks). Not for a
        sibling that took a hit to its last block itself: `request` can take the same hit now (else
        the group's siblings would be admitted one a step, each waiting for the one before)."""
        n, bs = request.num_tokens, self.block_size
        k = n // bs  # whole blocks
        if (not self._whole or k == 0 or n - (n - 1) // bs * bs < 2 or request.num_computed_tokens
                or request.skip_reading_prefix_cache or not self._has_siblings(request)
                or self._recent_map is not self._pool.cached_block_hash_to_block):  # reset: none are live
            return False
        from vllm.v1.request import RequestStatus

        # running, not yet counted past the last block's start, and given slots to `n`: being scheduled
        # to its end now, from before its last block
        last = (n - 1) // bs * bs
        return any(other.status == RequestStatus.RUNNING and other.num_computed_tokens < last
                   and len(blocks or ()) * bs >= n
                   for other, blocks in self._siblings(request, request.block_hashes, k))

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length: int) -> tuple[tuple[list], int, int]:
        request, bs = self._request, self.block_size
        n = request.num_tokens if request is not None else 0
        if max_cache_hit_length != n - 1:  # not vLLM's cap of the request being looked up
            return self._lookup(block_hashes, max_cache_hit_length)
        (blocks,), length, uncached = self._lookup(block_hashes, n)  # every whole block
        if length < n // bs * bs:
            return (blocks,), length, uncached  # what the cap gives: not every whole block is cached
        if n % bs == 0:
            if blocks[-1].block_id in self._fresh:  # written by this step's forward: vLLM's hit
                return (blocks[:-1],), length - bs, uncached
        elif (tail := self._sibling_tail(request, block_hashes, len(blocks))) is not None:
            blocks, self._took_tail = [*blocks, tail], True
        else:
            return (blocks,), length, uncached
        self.whole_prompt_hits += 1  # all but the last token computed: a sub-block hit
        return (blocks,), n - 1, uncached

    def _has_siblings(self, request) -> bool:
        """Whether `request` may take a sibling's partly filled block, or be such a sibling: whole blocks
        hashed, token ids alone (no multimodal input or embeddings)."""
        return (self._tails and bool(request.block_hashes) and not request.mm_features
                and request.prompt_embeds is None)

    def _sibling_tail(self, request, block_hashes, k: int):
        """The block after the first `k` of a live sibling of `request` which computed its tokens in an
        earlier step; None if none."""
        if not self._has_siblings(request):
            return None
        n = request.num_tokens
        for other, blocks in self._siblings(request, block_hashes, k):
            if (blocks is not None and len(blocks) > k and other.num_computed_tokens >= n
                    and not blocks[k].is_null):
                return blocks[k]
        return None

    def _siblings(self, request, block_hashes, k: int):
        """The requests kept as siblings (`_recent`, all `_has_siblings`) with `request`'s tokens: the same
        first `k` block hashes (its whole blocks), then the same tokens; most recent first, each with the
        blocks it holds (None: none)."""
        n, start = request.num_tokens, k * self.block_size
        tokens = request.all_token_ids[start:n]
        owned = self._manager.req_to_blocks
        for other in reversed(self._recent.get(block_hashes[k - 1], ())):
            if other.block_hashes[:k] == block_hashes[:k] and other.all_token_ids[start:n] == tokens:
                yield other, owned.get(other.request_id)

    def _lookup(self, block_hashes, max_cache_hit_length: int) -> tuple[tuple[list], int, int]:
        bs = self.block_size
        limit = min(len(block_hashes), max_cache_hit_length // bs)
        hit, k = self._longest(block_hashes, limit)
        if k:
            k = self._still_first(hit, k)
        if k == 0:
            (blocks,), length, uncached = self._find(block_hashes, max_cache_hit_length)
            self._remember(None, 0, block_hashes, blocks)
            return (blocks,), length, uncached
        blocks = hit.blocks[:k]
        if k < limit:  # the rest as vLLM looks it up: later blocks may be cached since
            (rest,), _, _ = self._find(block_hashes[k:limit], (limit - k) * bs)
            blocks += rest
        self.hits += 1
        self.reused_blocks += k
        self._remember(hit, k, block_hashes, blocks)
        return (blocks,), len(blocks) * bs, 0

    def estimate_cached_tokens(self, request) -> int:
        """vLLM's: the most tokens any of the request's blocks was cached under. A block's count is its
        end in the prompts it belongs to, so it grows along the request's blocks: the last block that
        has one holds the most."""
        blocks = self._manager.req_to_blocks.get(request.request_id) or ()
        for block in reversed(blocks):
            tokens = block.block_hash_num_tokens
            if tokens is not None:
                return tokens
        return 0

    def _longest(self, block_hashes, limit: int) -> tuple[_Hit | None, int]:
        """The remembered lookup whose hashes begin the most of `block_hashes[:limit]`, and how many."""
        best, most = None, 0
        if limit == 0:
            return best, most
        first = block_hashes[0]
        for hit in reversed(self._hits):
            if hit.hashes[0] != first:
                continue
            k = _common_prefix(hit.hashes, block_hashes, min(len(hit.hashes), limit))
            if k > most:
                best, most = hit, k
                if k == limit:
                    break
        return best, most

    def _still_first(self, hit: _Hit, k: int) -> int:
        """How many of `hit`'s first `k` blocks the cache map still returns for their keys."""
        if hit.keys is None:
            hit.keys = [self._key(h, 0) for h in hit.hashes]
        keys, blocks = hit.keys[:k], hit.blocks[:k]
        cache_map = self._pool.cached_block_hash_to_block  # vLLM's map now (a new one after each reset)
        get_one = cache_map.get_one_block  # the block vLLM's walk takes for a key
        table = getattr(cache_map, "_cache", None)  # its table: key -> a block, or a dict of them
        found = list(map(table.get if isinstance(table, dict) else get_one, keys))  # in C for a dict
        if found == blocks:
            return k
        for i, (value, block) in enumerate(zip(found, blocks)):
            if value is not block and not (type(value) is dict and get_one(keys[i]) is block):
                return i
        return k

    def _remember(self, hit: _Hit | None, k: int, block_hashes, blocks: list) -> None:
        n = len(blocks)
        if n == 0:
            return
        if hit is not None and n == k == len(hit.blocks):
            self._hits.remove(hit)  # the same lookup again: most recent now
            self._hits.append(hit)
            return
        keys = None  # made on the first reuse: a lookup no later request repeats costs two list copies
        if hit is not None:  # (its keys are made: `_still_first` ran)
            keys = hit.keys[:k] + [self._key(h, 0) for h in block_hashes[k:n]]
            if k == len(hit.blocks):
                self._hits.remove(hit)  # this one extends it
        self._hits.append(_Hit(list(block_hashes[:n]), list(blocks), keys))
        del self._hits[: -self.size]


def applies(manager) -> bool:
    """Whether `manager`'s prefix-cache lookup is the plain walk this memo reproduces."""
    from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    coordinator = getattr(manager, "coordinator", None)
    if not (getattr(manager, "enable_caching", False) and type(coordinator) is UnitaryKVCacheCoordinator):
        return False
    group = coordinator.kv_cache_config.kv_cache_groups[0]
    return (type(coordinator.single_type_managers[0]) is FullAttentionManager
            and not coordinator.eagle_group_ids and coordinator.dcp_world_size == 1
            and coordinator.pcp_world_size == 1
            and coordinator.block_pool.hash_block_size == coordinator.block_size
            and type(group.kv_cache_spec) is FullAttentionSpec)


def _common_prefix(a: list, b, n: int) -> int:
    """The length of the longest common prefix of `a[:n]` and `b[:n]` (whose first items are equal)."""
    if a[:n] == b[:n]:
        return n
    lo, hi = 1, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
