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

    def admit(self, rid: str, tokens: list, salt, computed: bool = True):
        """Look `tokens` up and allocate them, as the scheduler admits a request; `computed`: its step
        has been scheduled (vLLM counts the request's tokens computed then), else it is being scheduled."""
        r = Request(request_id=rid, prompt_token_ids=list(tokens), pooling_params=None,
                    sampling_params=SamplingParams(max_tokens=64), block_hasher=self.hasher, cache_salt=salt)
        blocks, hit = self.kv.get_computed_blocks(r)[:2]
        new = self.kv.allocate_slots(r, r.num_tokens - hit, hit, blocks)
        if new is None:
            return hit, None
        r.num_computed_tokens = r.num_tokens if computed else hit
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
    """A whole-prompt hit: a prompt cached to its last token gets all its blocks but the last shared, the
    last as a private copy (vLLM's copy-on-write) of the cached one, for a prompt of whole blocks, or of a
    sibling's partly filled one, and one token to compute; vLLM alone computes the last block's tokens
    again. Where that block is written by the step being scheduled (cached in it, or a sibling computing
    it), or a sibling's tokens differ, or not every whole block is cached, vLLM's hit stands."""
    rng = random.Random(7)
    whole, plain = Side(hasher, 64, memo=False), Side(hasher, 64, memo=False)
    memo = CacheHitMemo.install(whole.kv)

    def admit(rid, tokens, computed=True):
        got, want = whole.admit(rid, tokens, None, computed), plain.admit(rid, tokens, None, computed)
        return got, want

    def new_step():
        whole.kv.new_step_starts()
        plain.kv.new_step_starts()

    def copies():
        return [(c.src_block_id, c.dst_block_id) for c in whole.kv.take_kv_cache_block_copies()[0]]

    for n in (4 * BS, 4 * BS + 5):  # whole blocks; a partly filled last block
        prompt = [rng.randrange(300, 32000) for _ in range(n)]
        assert admit(f"a{n}", prompt, computed=False)[0][0] == 0
        first = whole.kv.get_block_ids(f"a{n}")[0]
        # in the step that computes the prompt: vLLM's hit (a copy would run before the forward writes it)
        got, want = admit(f"a{n}.2", prompt, computed=False)
        assert got == want and got[0] == (n - 1) // BS * BS and not copies()
        new_step()
        whole.requests[f"a{n}"].num_computed_tokens = plain.requests[f"a{n}"].num_computed_tokens = n
        (hit, (ids,)), (vllm_hit, _) = admit(f"b{n}", prompt)
        assert hit == n - 1 and vllm_hit == (n - 1) // BS * BS
        assert ids[:-1] == first[:-1] and ids[-1] not in first and len(ids) == len(first)
        assert copies() == [(first[-1], ids[-1])]
    assert memo.whole_prompt_hits == 2
    new_step()
    # a sibling with other tokens in the partly filled block: vLLM's hit
    other = prompt[:4 * BS] + [rng.randrange(300, 32000) for _ in range(5)]
    got, want = admit("c", other)
    assert got == want and got[0] == 4 * BS
    # cached but for its last block: vLLM's hit too
    other = prompt[:3 * BS] + [rng.randrange(300, 32000) for _ in range(BS)]
    got, want = admit("e", other)
    assert got == want and got[0] == 3 * BS
    assert memo.whole_prompt_hits == 2 and not copies()
    # many samples: those admitted with the first compute their own last block; every later one takes one
    n = 3 * BS + 9
    prompt = [rng.randrange(300, 32000) for _ in range(n)]
    first = [admit(f"g{i}", prompt, computed=False)[0] for i in range(6)]
    new_step()
    for i in range(6):
        whole.requests[f"g{i}"].num_computed_tokens = plain.requests[f"g{i}"].num_computed_tokens = n
    tails = {whole.kv.get_block_ids(f"g{i}")[0][-1] for i in range(6)}
    later = [admit(f"h{i}", prompt) for i in range(10)]
    assert [hit for (hit, _), _ in later] == [n - 1] * 10 and [w[0] for _, w in later] == [3 * BS] * 10
    made = copies()
    assert len(made) == 10 and {src for src, _ in made} <= tails and memo.whole_prompt_hits == 12
    assert [hit for hit, _ in first] == [0] + [3 * BS] * 5
    # a lookup with a limit of its own (vLLM 0.33's aux-output connector; 0.32 has no such argument)
    if "max_cache_hit_length" in inspect.signature(KVCacheManager.get_computed_blocks).parameters:
        r = Request(request_id="f", prompt_token_ids=list(prompt), pooling_params=None,
                    sampling_params=SamplingParams(max_tokens=4), block_hasher=hasher)
        assert whole.kv.get_computed_blocks(r, 2 * BS)[1] == 2 * BS


def test_a_sibling_of_a_prompt_computed_in_this_step_waits_for_it(hasher):
    """`waits_for_sibling`: a new request whose tokens a running sibling is scheduled to compute in this
    step waits, then takes a whole-prompt hit; not where the sibling is not computing them now, computes
    only its last block (it took a hit: the same hit is there for the new request now, and waiting for
    it would admit a group's siblings one a step), its tokens differ, the last block has one token to
    compute, or whole-prompt hits are off."""
    from vllm.v1.request import RequestStatus

    rng = random.Random(3)
    side = Side(hasher, 64, memo=False)
    memo = CacheHitMemo.install(side.kv)

    def request(rid, tokens, **params):
        return Request(request_id=rid, prompt_token_ids=list(tokens), pooling_params=None,
                       sampling_params=SamplingParams(max_tokens=8, **params), block_hasher=side.hasher)

    for n in (3 * BS + 9, 4 * BS):  # a partly filled last block; whole blocks
        prompt = [rng.randrange(300, 32000) for _ in range(n)]
        assert not memo.waits_for_sibling(request(f"x{n}", prompt))  # no sibling yet
        side.admit(f"a{n}", prompt, None, computed=False)
        first = side.requests[f"a{n}"]
        assert not memo.waits_for_sibling(request(f"y{n}", prompt))  # a sibling not running
        first.status = RequestStatus.RUNNING
        assert memo.waits_for_sibling(request(f"b{n}", prompt))
        other = prompt[:-3] + [t + 1 for t in prompt[-3:]]
        assert not memo.waits_for_sibling(request(f"c{n}", other))  # other tokens in the last block
        longer = prompt + [5]
        assert not memo.waits_for_sibling(request(f"l{n}", longer))  # the sibling does not reach its end
        assert not memo.waits_for_sibling(request(f"s{n}", prompt, skip_reading_prefix_cache=True))
        first.num_computed_tokens = (n - 1) // BS * BS  # a sibling that took a hit to its last block
        assert not memo.waits_for_sibling(request(f"h{n}", prompt))  # (the same hit is there now)
        first.num_computed_tokens = (n - 1) // BS * BS - 1
        assert memo.waits_for_sibling(request(f"k{n}", prompt))
        first.num_computed_tokens = 0
        side.kv.new_step_starts()
        first.num_computed_tokens = n  # the step was scheduled
        later = request(f"b{n}", prompt)
        assert not memo.waits_for_sibling(later)
        assert side.kv.get_computed_blocks(later)[1] == n - 1  # and now a whole-prompt hit
    prompt = [rng.randrange(300, 32000) for _ in range(3 * BS + 1)]  # one token to compute either way
    side.admit("o", prompt, None, computed=False)
    side.requests["o"].status = RequestStatus.RUNNING
    assert not memo.waits_for_sibling(request("o2", prompt))
    plain = Side(hasher, 64, memo=True)  # the memo without whole-prompt hits
    prompt = [rng.randrange(300, 32000) for _ in range(3 * BS + 9)]
    plain.admit("p", prompt, None, computed=False)
    plain.requests["p"].status = RequestStatus.RUNNING
    assert not plain.memo.waits_for_sibling(request("p2", prompt))


@pytest.mark.parametrize("seed", [0, 1])
def test_whole_prompt_hits_keep_vllms_block_accounting(hasher, seed):
    """Random samples of prompts of whole and part blocks arriving over steps, some in the step that
    computes their prompt, with frees and evictions: every hit is vLLM's or all but the last token, and
    once all requests end and the copies' retained blocks are released (as the scheduler does after the
    copying step), every block is free again: no reference taken on a sibling's block is lost."""
    rng = random.Random(seed)
    side, plain = Side(hasher, 80, memo=False), Side(hasher, 80, memo=False)
    memo = CacheHitMemo.install(side.kv)
    lengths = [rng.choice([2, 3, 5]) * BS + rng.choice([0, 0, 1, 9]) for _ in range(4)]
    prompts = [[rng.randrange(300, 32000) for _ in range(n)] for n in lengths]
    pending = []  # this step's requests: computed when the next step starts
    resets = 0
    for step in range(300):
        if rng.random() < 0.3:
            for r in pending:
                r.num_computed_tokens = r.num_tokens
            pending.clear()
            side.kv.new_step_starts()
            copies, retained = side.kv.take_kv_cache_block_copies()
            side.kv.block_pool.free_blocks(retained)
        live = sorted(side.requests)
        if rng.random() < 0.5 or not live:
            tokens = rng.choice(prompts)
            for k in range(rng.choice([1, 3])):
                rid = f"r{step}.{k}"
                got = side.admit(rid, tokens, None, computed=False)
                want = plain.admit(rid, tokens, None, computed=False)
                if got[1] is None or want[1] is None:
                    continue
                assert got[0] in (want[0], len(tokens) - 1), (got[0], want[0], len(tokens))
                pending.append(side.requests[rid])
                plain.requests[rid].num_computed_tokens = plain.requests[rid].num_tokens
        elif rng.random() < 0.9:
            rid = rng.choice(live)
            if rid in plain.requests:
                plain.free(rid)
            r = side.requests[rid]
            if r in pending:
                pending.remove(r)
            side.free(rid)
        else:  # everything ends, then the prefix cache is reset: no sibling is taken from before it
            for rid in live:
                side.free(rid)
            for rid in list(plain.requests):
                plain.free(rid)
            pending.clear()
            side.kv.block_pool.free_blocks(side.kv.take_kv_cache_block_copies()[1])
            assert side.kv.reset_prefix_cache() and plain.kv.reset_prefix_cache()
            resets += 1
    for rid in list(side.requests):
        side.free(rid)
    side.kv.block_pool.free_blocks(side.kv.take_kv_cache_block_copies()[1])
    assert memo.whole_prompt_hits > 10 and resets
    assert side.kv.block_pool.get_num_free_blocks() == side.kv.block_pool.num_gpu_blocks - 1


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
