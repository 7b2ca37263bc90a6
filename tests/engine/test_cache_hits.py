"""engine/cache_hits.py: a prefix-cache lookup that starts from a recent lookup's blocks returns the
blocks vLLM's own walk returns, and the cached-token count vLLM's own count gives. Two of vLLM's
KV-cache managers, one with the memo, run the same random traffic (prompts over shared beginnings,
samples of one prompt, generated tokens, frees, evictions from a small pool) and must agree on every
block id."""

import random

import pytest
import torch
from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.request import Request

from vllm_relay.engine.cache_hits import CacheHitMemo, applies
from vllm_relay.engine.hashes import PromptHashMemo

BS = 16


@pytest.fixture(scope="module")
def hasher():
    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return get_request_block_hasher(BS, fn)


def manager(num_blocks: int, spec=None, **kwargs) -> KVCacheManager:
    spec = spec or FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return KVCacheManager(config, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS, **kwargs)


class Side:
    """One manager and its requests; `admit`, `decode` and `free` as vLLM's scheduler calls them."""

    def __init__(self, hasher, num_blocks: int, memo: bool):
        self.kv = manager(num_blocks)
        self.vllm_estimate = self.kv.estimate_cached_tokens  # vLLM's own, bound before any install
        self.memo = CacheHitMemo.install(self.kv) if memo else None
        self.hasher = PromptHashMemo(hasher, BS) if memo else hasher
        self.requests: dict[str, Request] = {}

    def admit(self, rid: str, tokens: list, salt):
        r = Request(request_id=rid, prompt_token_ids=list(tokens), pooling_params=None,
                    sampling_params=SamplingParams(max_tokens=64), block_hasher=self.hasher, cache_salt=salt)
        blocks, hit = self.kv.get_computed_blocks(r)[:2]
        new = self.kv.allocate_slots(r, r.num_tokens - hit, hit, blocks)
        if new is None:
            return hit, None
        r.num_computed_tokens = r.num_tokens
        self.requests[rid] = r
        return hit, self.kv.get_block_ids(rid)

    def decode(self, rid: str, token: int):
        r = self.requests[rid]
        r.append_output_token_ids(token)
        new = self.kv.allocate_slots(r, 1)
        if new is not None:
            r.num_computed_tokens += 1
        return new is not None

    def free(self, rid: str):
        self.kv.free(self.requests.pop(rid))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_memo_returns_the_blocks_of_vllms_walk_on_random_traffic(hasher, seed):
    rng = random.Random(seed)
    memo, plain = Side(hasher, 96, memo=True), Side(hasher, 96, memo=False)
    roots = [[rng.randrange(300, 32000) for _ in range(rng.randrange(1, 40) * BS + rng.randrange(BS))]
             for _ in range(5)]
    samples = duplicates = resets = 0
    for step in range(400):
        action = rng.random()
        live = sorted(plain.requests)
        if action < 0.45 or not live:
            root = rng.choice(roots)
            if live and rng.random() < 0.3:  # a conversation's next turn: a live request's tokens so far
                root = list(plain.requests[rng.choice(live)].all_token_ids)
            cut = rng.randrange(1, len(root) + 1)
            tail = [rng.randrange(300, 32000) for _ in range(rng.choice([0, 0, 3, BS, 2 * BS + 5]))]
            tokens, salt = root[:cut] + tail, rng.choice([None, None, None, "a"])
            for k in range(rng.choice([1, 1, 4])):  # a prompt's n samples arrive together
                rid = f"r{step}.{k}"
                got, want = memo.admit(rid, tokens, salt), plain.admit(rid, tokens, salt)
                assert got == want, (step, k)
                samples += got[0] > 0 and k > 0
        elif action < 0.8:
            rid = rng.choice(live)
            token = rng.choice([301, 302, rng.randrange(300, 32000)])  # samples alike: equal blocks
            assert memo.decode(rid, token) == plain.decode(rid, token)
            assert memo.kv.get_block_ids(rid) == plain.kv.get_block_ids(rid)
        elif action < 0.97:
            rid = rng.choice(live)
            memo.free(rid)
            plain.free(rid)
        else:  # everything ends, then the prefix cache is reset (vLLM builds a new cache map)
            for rid in live:
                memo.free(rid)
                plain.free(rid)
            assert memo.kv.reset_prefix_cache() and plain.kv.reset_prefix_cache()
            resets += 1
        table = plain.kv.block_pool.cached_block_hash_to_block._cache  # (a new one after a reset)
        duplicates += any(type(v) is dict for v in table.values())
        for rid, r in memo.requests.items():
            assert memo.kv.estimate_cached_tokens(r) == plain.vllm_estimate(plain.requests[rid])
    assert memo.memo.hits > 20 and samples > 5  # the memo served lookups, siblings among them
    assert duplicates  # and blocks of equal content cached twice, which the walk takes the first of
    assert resets  # and lookups after a reset, in the new map
    assert memo.kv.block_pool.get_num_free_blocks() == plain.kv.block_pool.get_num_free_blocks()


def test_a_remembered_block_evicted_since_is_looked_up_again(hasher):
    """The memo's blocks are freed and their pool slots reused by other prompts: the next sample of
    the first prompt gets what vLLM's walk finds now, not the remembered blocks."""
    rng = random.Random(5)
    memo, plain = Side(hasher, 24, memo=True), Side(hasher, 24, memo=False)
    first = [rng.randrange(300, 32000) for _ in range(10 * BS + 3)]
    for side in (memo, plain):
        side.admit("a", first, None)
        side.admit("a2", first, None)  # a sample: its lookup is remembered
        side.free("a")
        side.free("a2")
    assert memo.memo.reused_blocks == 0 and len(memo.memo._hits) == 1
    for i in range(3):  # fills the pool: evicts most of the first prompt's cached blocks
        other = [rng.randrange(300, 32000) for _ in range(7 * BS)]
        assert memo.admit(f"o{i}", other, None) == plain.admit(f"o{i}", other, None)
    got, want = memo.admit("b", first, None), plain.admit("b", first, None)
    assert got == want and 0 < want[0] < 10 * BS  # a shorter hit than remembered, the same blocks
    assert memo.memo.hits == 1


def test_installed_only_where_vllms_lookup_is_the_plain_walk():
    assert applies(manager(32))
    assert not applies(manager(32, enable_caching=False))
    assert not applies(manager(32, use_eagle=True))
    sliding = SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32,
                                sliding_window=64)
    assert not applies(manager(32, spec=sliding))
    kv = manager(32, use_eagle=True)
    find = kv.coordinator.find_longest_cache_hit
    assert CacheHitMemo.install(kv) is None and kv.coordinator.find_longest_cache_hit == find
