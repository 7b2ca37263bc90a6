"""engine/hashes.py: the n samples of a prompt get its block hashes computed once, and a prompt that
begins like an earlier one reuses the hashes of the whole blocks they share, equal to what vLLM's own
hasher computes for each of them (sha256, fresh random prompts); anything that could change a hash
(salt, LoRA, generated tokens) goes to vLLM's hasher."""

import random

import pytest
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from vllm_relay.engine.hashes import PromptHashMemo

from .test_core import ecr, make_core, model_path, submit  # noqa: F401


@pytest.fixture(scope="module")
def hasher():
    fn = get_hash_fn_by_name("sha256")
    init_none_hash(fn)
    return get_request_block_hasher(16, fn)


class Counting:
    def __init__(self, hasher):
        self.hasher, self.calls, self.blocks = hasher, 0, 0

    def __call__(self, request):
        self.calls += 1
        hashes = self.hasher(request)
        self.blocks += len(hashes)
        return hashes


def request(ids, hasher, rid="r", salt=None, lora=None):
    return Request(request_id=rid, prompt_token_ids=list(ids), sampling_params=SamplingParams(max_tokens=4),
                   pooling_params=None, block_hasher=hasher, cache_salt=salt, lora_request=lora)


def test_siblings_get_the_hashes_vllm_computes_hashing_once(hasher):
    rng = random.Random(11)
    memo = PromptHashMemo(Counting(hasher), 16)
    ids = [rng.randrange(100, 32000) for _ in range(16 * 37 + 5)]
    want = request(ids, hasher).block_hashes
    got = [request(ids, memo, rid=str(i)) for i in range(8)]
    assert memo.hasher.calls == 1 and memo.hits == 7
    assert all(r.block_hashes == want for r in got) and len(want) == 37
    assert len({id(r.block_hashes) for r in got}) == 8  # each request owns its list
    # a generated token completing a block: vLLM's hasher, on this request only
    r = got[0]
    r.append_output_token_ids([5] * 11)
    assert memo.hasher.calls == 2 and r.block_hashes[:37] == want and len(r.block_hashes) == 38
    assert all(len(x.block_hashes) == 37 for x in got[1:])


def test_salt_lora_and_other_tokens_are_hashed_by_vllm(hasher):
    rng = random.Random(12)
    memo = PromptHashMemo(Counting(hasher), 16)
    ids = [rng.randrange(100, 32000) for _ in range(16 * 9)]
    plain = request(ids, memo)
    salted = request(ids, memo, salt="a")
    assert memo.hasher.calls == 2 and salted.block_hashes == request(ids, hasher, salt="a").block_hashes
    assert salted.block_hashes[0] != plain.block_hashes[0]
    lora = LoRARequest("adapter", 1, "/nonexistent")
    with_lora = request(ids, memo, lora=lora)
    assert memo.hasher.calls == 3 and with_lora.block_hashes == request(ids, hasher, lora=lora).block_hashes
    other = ids[:-1] + [ids[-1] + 1]  # differs in the last token only: its last block's hash differs
    blocks = memo.hasher.blocks
    got = request(other, memo).block_hashes
    assert got == request(other, hasher).block_hashes and got[-1] != plain.block_hashes[-1]
    assert memo.hasher.calls == 4 and memo.hasher.blocks == blocks + 1  # the first 8 blocks reused
    assert memo.hits == 0


def test_prompts_that_begin_alike_reuse_the_hashes_of_their_common_blocks(hasher):
    """Questions over one document, a prompt that begins a longer one, prompts that part inside a
    block: each gets vLLM's hashes, and vLLM's hasher computes only the blocks past the whole ones
    an earlier prompt under the same salt shares."""
    rng = random.Random(14)
    memo = PromptHashMemo(Counting(hasher), 16)
    doc = [rng.randrange(100, 32000) for _ in range(16 * 20 + 7)]  # 20 whole blocks and 7 tokens

    def check(ids, salt=None):
        before = memo.hasher.blocks
        got = request(ids, memo, salt=salt).block_hashes
        assert got == request(ids, hasher, salt=salt).block_hashes
        return memo.hasher.blocks - before

    assert check(doc + [1] * 40) == 22  # the first: every block
    assert check(doc + [2] * 40) == 2  # parts in block 20: blocks 0-19 reused
    assert check(doc[:100]) == 0 and memo.hits == 1  # begins the document: all 6 of its blocks
    assert check(doc[:100], salt="s") == 6  # another salt: nothing shared
    assert check([7] + doc[1:]) == 20  # parts in the first token
    for _ in range(40):  # random prompts over a few shared beginnings, random salts
        base = rng.choice([doc, doc[:50], [9] * 70])
        cut = rng.randrange(0, len(base) + 1)
        ids = base[:cut] + [rng.randrange(100, 32000) for _ in range(rng.randrange(0, 60))]
        if ids:
            check(ids, salt=rng.choice([None, None, "s"]))
    assert memo.reused_blocks > 0 and len(memo._prompts) <= memo.size


def test_least_recently_used_prompts_leave_the_memo(hasher):
    memo = PromptHashMemo(Counting(hasher), 16, size=2)
    prompts = [[i] * 32 for i in range(100, 103)]
    for ids in prompts:
        request(ids, memo)
    request(prompts[2], memo)
    request(prompts[0], memo)  # evicted: hashed again
    assert memo.hits == 1 and memo.hasher.calls == 4


def test_the_engine_core_hashes_n_copies_of_a_prompt_once(model_path):  # noqa: F811
    core = make_core(model_path)
    memo = core.request_block_hasher
    assert isinstance(memo, PromptHashMemo)
    ids = [random.Random(13).randrange(100, 1000) for _ in range(100)]
    reqs = [submit(core, ecr(f"{i}_parent", ids)) for i in range(4)]
    assert memo.hits == 3
    want = request(ids, memo.hasher).block_hashes  # vLLM's hasher of this core
    assert all(r.block_hashes == want for r in reqs) and len(want) == 6
    plain = make_core(model_path, backend=None)  # no relay: vLLM's hasher as it is
    assert not isinstance(plain.request_block_hasher, PromptHashMemo)
