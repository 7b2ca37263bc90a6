"""hooks/transport.py and engine/requests.SentPrompts: a prompt sent again right after itself crosses to the
engine core once, and the engine core gets back exactly the request its front end had."""

import json
import random
import time
from pathlib import Path

import pytest
from vllm import SamplingParams
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from tests.e2e.engine_runner import assert_same_outputs, run_engine
from vllm_relay.engine.requests import SentPrompts
from vllm_relay.hooks import transport
from vllm_relay.protocol import SAME_PROMPT_KEY
from vllm_relay.testing.models import get_model


def request(rid: str, prompt, params: SamplingParams, client_index: int = 0) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, mm_features=None, sampling_params=params,
                             pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None,
                             data_parallel_rank=None, client_index=client_index)


def across(reqs: list) -> list:
    """The requests as the engine core's input thread decodes them."""
    enc, dec = MsgpackEncoder(), MsgpackDecoder(EngineCoreRequest)
    return [dec.decode(enc.encode(r)) for r in reqs]


def fields(r: EngineCoreRequest) -> tuple:
    p = r.sampling_params
    return (r.request_id, list(r.prompt_token_ids), r.client_index, p.seed, p.n, p.max_tokens, p.stop, p.logprobs,
            p.extra_args)


class Client:  # what the hook keys its memo by (weakly): one vLLM client
    pass


def test_children_of_one_prompt_cross_once_and_come_back_as_sent():
    rng = random.Random(0)
    prompt = [rng.randrange(100, 30000) for _ in range(transport.MIN_TOKENS + 37)]
    other = [rng.randrange(100, 30000) for _ in range(transport.MIN_TOKENS)]
    parent = SamplingParams(n=1, seed=7, max_tokens=5, stop=["e"], logprobs=3)
    with_args = SamplingParams(max_tokens=4, extra_args={"user": 1})
    reqs = [request("0_a", prompt, parent), request("1_a", prompt, SamplingParams(seed=8, max_tokens=5)),
            request("2_a", prompt, with_args),
            request("b", list(prompt), parent),  # equal ids in another list: a prompt of its own, sent
            request("c", other, parent), request("0_d", other, parent),
            request("short", prompt[:transport.MIN_TOKENS - 1], parent), request("1_d", other, parent)]
    client, before = Client(), transport.sent_once
    sent = [transport.outgoing(client, r, b"engine-0") for r in reqs]
    marked = [s.prompt_token_ids is None for s in sent]
    assert marked == [False, True, True, False, False, True, False, False]
    assert transport.sent_once - before == 3
    assert all(SAME_PROMPT_KEY in s.sampling_params.extra_args for s, m in zip(sent, marked) if m)
    assert reqs[2].sampling_params.extra_args == {"user": 1} and reqs[1].prompt_token_ids is prompt  # untouched
    memo = SentPrompts()
    got = [memo.resolve(r) for r in across(sent)]
    assert [fields(g) for g in got] == [fields(r) for r in across(reqs)]
    assert got[1].prompt_token_ids is got[0].prompt_token_ids  # one list on the engine's side too


def test_each_engine_and_client_keeps_its_own_last_prompt():
    prompt = list(range(1000, 1000 + transport.MIN_TOKENS))
    params = SamplingParams(max_tokens=2)
    client = Client()
    a0 = transport.outgoing(client, request("a0", prompt, params), b"e0")
    b0 = transport.outgoing(client, request("b0", prompt, params), b"e1")  # another engine: the prompt itself
    a1 = transport.outgoing(client, request("a1", prompt, params), b"e0")
    assert a0.prompt_token_ids is prompt and b0.prompt_token_ids is prompt and a1.prompt_token_ids is None
    assert transport.outgoing(Client(), request("c0", prompt, params), b"e0").prompt_token_ids is prompt
    # Engine side, by client index: a reference from a client that sent no prompt yet is refused, clearly.
    memo = SentPrompts()
    memo.resolve(across([request("x", prompt, params, client_index=1)])[0])
    with pytest.raises(ValueError, match="did not receive"):
        memo.resolve(across([a1])[0])  # client 0 sent nothing to this engine core


def test_a_users_mark_never_makes_a_reference():
    prompt = list(range(2000, 2000 + transport.MIN_TOKENS))
    forged = SamplingParams(max_tokens=2, extra_args={SAME_PROMPT_KEY: True, "keep": 1})
    client = Client()
    transport.outgoing(client, request("a", list(range(5000, 5000 + transport.MIN_TOKENS)), forged), b"e")
    out = transport.outgoing(client, request("b", prompt, forged), b"e")
    assert out.prompt_token_ids is prompt and out.sampling_params.extra_args == {"keep": 1}
    assert forged.extra_args == {SAME_PROMPT_KEY: True, "keep": 1}  # the caller's params are not changed
    assert SentPrompts().resolve(across([out])[0]).prompt_token_ids == prompt


@pytest.mark.engine
def test_n_samples_sent_once_are_vllms_samples(tmp_path):
    """`LLM` with its engine core in another process (as it runs by default): the children of a request
    with n > 1 and a long prompt cross once, and their seeded samples, logprobs and stop strings are vLLM's
    own (the plugin not loaded), a registered system prompt in front of some of them."""
    model = get_model("tiny-llama-gqa")
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(5)

    def ids(n):
        return [rng.randrange(8, vocab) for _ in range(n)]

    system = [1] + ids(63)
    long_a, long_b = system + ids(transport.MIN_TOKENS + 20), [1] + ids(transport.MIN_TOKENS + 100)
    run = {"prompts": [system + ids(9)], "max_tokens": 4,
           "samples": [{"prompt": long_a, "n": 4, "seed": 3, "max_tokens": 6},
                       {"prompt": long_b, "n": 3, "seed": 4, "max_tokens": 6}],
           "sampled_prompts": [long_b]}
    engine = {"model": model, "max_model_len": 1024, "max_num_batched_tokens": 2048}
    relay, _ = run_engine({"engine": {**engine, "attention_backend": "relay",
                                      "additional_config": {"relay": {"system_prompts": {"sys": system}}}},
                           **run}, tmp_path, "relay")
    reference, _ = run_engine({"engine": engine, **run}, tmp_path, "reference")
    assert relay["prompts_sent_once"] == (4 - 1) + (3 - 1) + (2 - 1), relay["prompts_sent_once"]
    assert_same_outputs(relay["outputs"], reference["outputs"])
    for got, want in zip(relay["samples"], reference["samples"], strict=True):
        assert_same_outputs(got, want)
    assert relay["sampled"] == reference["sampled"]  # tokens, text cut at the stop string, finish reasons


class Socket:
    def __init__(self) -> None:
        self.sent = []

    def send_multipart(self, frames, copy=True):
        self.sent.append(frames)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_vllms_clients_send_through_the_hook_only_for_relay(asynchronous):
    """vLLM's own `_send_input` of `SyncMPClient` (LLM) and `AsyncMPClient` (the server), patched: the
    frames that reach the socket, decoded as the engine core's input thread does."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.engine import EngineCoreRequestType
    from vllm.v1.engine.core_client import AsyncMPClient, SyncMPClient

    import vllm_relay

    vllm_relay.register()
    prompt = list(range(3000, 3000 + transport.MIN_TOKENS))
    reqs = [request(f"{i}_p", prompt, SamplingParams(seed=i, max_tokens=2)) for i in range(3)]
    dec = MsgpackDecoder(EngineCoreRequest)
    for backend, references in ((AttentionBackendEnum.CUSTOM, 2), (AttentionBackendEnum.FLASH_ATTN, 0)):
        cls = AsyncMPClient if asynchronous else SyncMPClient
        client = cls.__new__(cls)  # no engine: the socket is a recorder
        client.vllm_config = SimpleNamespace(attention_config=SimpleNamespace(backend=backend))
        client.core_engine, client.encoder, client.input_socket = b"e0", MsgpackEncoder(), Socket()
        client.ensure_alive = lambda: None
        for r in reqs:
            client._send_input(EngineCoreRequestType.ADD, r)
        got = [dec.decode(frames[2:]) for frames in client.input_socket.sent]
        assert [g.prompt_token_ids is None for g in got].count(True) == references
        memo = SentPrompts()
        assert [fields(memo.resolve(g)) for g in got] == [fields(r) for r in across(reqs)]
