"""engine/cache_hits.py: a prefix-cache lookup that starts from a recent lookup's blocks returns the
blocks vLLM's own walk returns, and the cached-token count vLLM's own count gives. Two of vLLM's
KV-cache managers, one with the memo, run the same random traffic (prompts over shared beginnings,
samples of one prompt, generated tokens, frees, evictions from a small pool) and must agree on every
block id."""

import inspect
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
        self.memo = CacheHitMemo.install(self.kv, whole_prompts=False) if memo else None
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


def test_a_prompt_cached_to_its_last_block_computes_its_last_token_into_a_copy(hasher):
    """A whole-prompt hit: a prompt of whole blocks, cached in full, gets all its blocks but the last
    shared, the last as a private copy of the cached one (vLLM's copy-on-write), and one token to compute;
    vLLM alone computes the whole last block again. A prompt that is not whole blocks, or not cached in
    full, or whose last block was cached in the step being scheduled (its forward writes it), gets what
    vLLM gives."""
    rng = random.Random(7)
    whole, plain = Side(hasher, 64, memo=False), Side(hasher, 64, memo=False)
    memo = CacheHitMemo.install(whole.kv)
    prompt = [rng.randrange(300, 32000) for _ in range(4 * BS)]
    for side in (whole, plain):
        assert side.admit("a", prompt, None)[0] == 0
    first = whole.kv.get_block_ids("a")[0]
    # in the step that computes it: vLLM's hit (the copy would run before the forward writes the block)
    assert whole.admit("a2", prompt, None)[0] == plain.admit("a2", prompt, None)[0] == 3 * BS
    assert whole.kv.get_block_ids("a2") == plain.kv.get_block_ids("a2")
    assert not whole.kv.take_kv_cache_block_copies()[0] and memo.whole_prompt_hits == 0
    whole.kv.new_step_starts()
    plain.kv.new_step_starts()
    assert plain.admit("b", prompt, None)[0] == 3 * BS  # vLLM: the last block computed again
    hit, (ids,) = whole.admit("b", prompt, None)
    assert hit == 4 * BS - 1 and ids[:3] == first[:3] and ids[3] not in first and len(ids) == 4
    copies, retained = whole.kv.take_kv_cache_block_copies()
    assert [(c.src_block_id, c.dst_block_id) for c in copies] == [(first[3], ids[3])]
    assert memo.whole_prompt_hits == 1
    # not whole blocks: the partial last block is never cached, so vLLM's hit stands
    ragged = prompt[:3 * BS] + [rng.randrange(300, 32000) for _ in range(5)]
    for side in (whole, plain):
        side.admit("c", ragged, None)
    assert whole.admit("d", ragged, None)[0] == plain.admit("d", ragged, None)[0] == 3 * BS
    # cached but for its last block: vLLM's hit stands too
    other = prompt[:3 * BS] + [rng.randrange(300, 32000) for _ in range(BS)]
    assert whole.admit("e", other, None)[0] == plain.admit("e", other, None)[0] == 3 * BS
    assert memo.whole_prompt_hits == 1 and not whole.kv.take_kv_cache_block_copies()[0]
    # a lookup with a limit of its own (vLLM 0.33's aux-output connector; 0.32 has no such argument)
    if "max_cache_hit_length" in inspect.signature(KVCacheManager.get_computed_blocks).parameters:
        r = Request(request_id="f", prompt_token_ids=list(prompt), pooling_params=None,
                    sampling_params=SamplingParams(max_tokens=4), block_hasher=hasher)
        assert whole.kv.get_computed_blocks(r, 2 * BS)[1] == 2 * BS


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
