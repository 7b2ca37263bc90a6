"""Engine-core hooks without an engine: a real scheduler (relay's subclass of vLLM's), a hand-built
EngineCore, no model.

`core` is an EngineCore object with only what preprocess/add/abort need (a stand-in executor that
records the workers' calls): a step is `schedule()`, a fake model output (one token per request
whose prefill is done), and `update_from_output()`, all through the patched EngineCore and relay's
scheduler. Routing, holding, fills, releases and counters are checked on the Request objects and
the registry.
"""

from types import SimpleNamespace

import msgspec
import pytest
import torch

import vllm_relay
from vllm_relay.engine.requests import ENGINE_ATTR, INFO_ATTR, relay_eligible
from vllm_relay.engine import RelayEngine
from vllm_relay.protocol import TAG_KEY, read_tag, relay_enabled
from vllm_relay.system_prompts.fill import fill_request_id
from vllm_relay.testing.models import get_model

MAX_MODEL_LEN = 512
SYS = list(range(100, 140))  # 40 tokens: two full blocks of 16 and a partial one
SHARED, KEPT = 32, SYS[32:]  # relay shares its whole blocks; a request computes the rest itself
OWN = [7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def model_path():
    return str(get_model("tiny-llama-gqa"))


def make_core(model_path, relay=None, tokenizer=False, backend="relay", batched_tokens=64, core_cls=None,
              **attrs):
    """An EngineCore with a real scheduler and prefix caching; RelayEngine attached if enabled.

    `core_cls` (a subclass of EngineCore) and `attrs` (attributes set before the RelayEngine is
    attached) let tests run vLLM's own subclass methods on it, e.g. DPEngineCoreProc's."""
    from vllm.config import AttentionConfig, CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_relay.register()
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=model_path, dtype="float32", max_model_len=MAX_MODEL_LEN,
                                 skip_tokenizer_init=not tokenizer),
        cache_config=CacheConfig(block_size=16, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=batched_tokens,
                                         max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False),
        attention_config=AttentionConfig(backend=AttentionBackendEnum.CUSTOM if backend else None),
        additional_config={"relay": {"max_prompts": 2, "max_prompt_tokens": 64,
                                     **(relay or {})}},
    )
    if relay_enabled(vllm_config):  # what the front end does to a relay config (hooks/frontend.py)
        from vllm_relay.engine.scheduler import select

        select(vllm_config)
    vllm_config.cache_config.num_gpu_blocks = 64
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    core = object.__new__(core_cls or EngineCore)
    core.vllm_config, core.mm_receiver_cache = vllm_config, None
    rpcs = []  # the workers' calls (pause_scheduler synchronizes the device through one, for example)
    core.model_executor = SimpleNamespace(rpcs=rpcs, collective_rpc=lambda method, *a, **k: rpcs.append(method) or [])
    for name, value in attrs.items():
        setattr(core, name, value)
    core.structured_output_manager = StructuredOutputManager(vllm_config)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    core.request_block_hasher = get_request_block_hasher(16, hash_fn)
    core.scheduler = vllm_config.scheduler_config.get_scheduler_cls()(
        vllm_config=vllm_config, kv_cache_config=kv, log_stats=True, block_size=16,
        structured_output_manager=core.structured_output_manager,
    )
    core.step_fn = lambda: (step(core), True)
    core.post_step = lambda model_executed: None
    if backend:
        RelayEngine.attach(core)
    return core


def step(core, scheduled: list | None = None):
    """One engine step with a fake model: every request past its prompt samples token 5. `scheduled`
    collects each step's tokens by request."""
    from vllm.v1.outputs import ModelRunnerOutput

    sched = core.scheduler
    out = sched.schedule()
    if scheduled is not None:
        scheduled.append(dict(out.num_scheduled_tokens))
    rids = list(out.num_scheduled_tokens)
    done = [sched.requests[r].num_computed_tokens >= sched.requests[r].num_prompt_tokens for r in rids]
    mro = ModelRunnerOutput(req_ids=rids, req_id_to_index={r: i for i, r in enumerate(rids)},
                            sampled_token_ids=[[5] if d else [] for d in done])
    return sched.update_from_output(out, mro)


def run_until_idle(core, max_steps=50):
    outputs = []
    for _ in range(max_steps):
        if not core.scheduler.has_requests():
            return outputs
        outputs.append(step(core))
    raise AssertionError("scheduler did not drain")


def ecr(rid, ids, max_tokens=4, salt=None, extra_args=None, **params):
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    sp = SamplingParams(max_tokens=max_tokens, extra_args=extra_args, **params)
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(ids), mm_features=None, sampling_params=sp,
                             pooling_params=None, arrival_time=0.0, lora_request=None, cache_salt=salt,
                             data_parallel_rank=None)


def submit(core, request):
    req, wave = core.preprocess_add_request(request)
    core.add_request(req, wave)
    return req


def relay_of(core) -> RelayEngine:
    return getattr(core, ENGINE_ATTR)


@pytest.fixture
def core(model_path):
    return make_core(model_path, relay={"system_prompts": {"sys": SYS}})


# ---- eligibility and rewriting -----------------------------------------------------------------


@pytest.mark.parametrize("change, eligible", [
    ({}, True),
    ({"prompt_token_ids": None}, False),
    ({"prompt_embeds": torch.zeros(3, 4)}, False),
    ({"mm_features": [object()]}, False),
    ({"lora_request": object()}, False),
    ({"sampling_params": None}, False),
    ({"resumable": True}, False),
    ({"abort_immediately": True}, False),
    ({"prompt_is_token_ids": [True]}, False),
])
def test_eligibility(change, eligible):
    assert relay_eligible(msgspec.structs.replace(ecr("r", SYS + OWN), **change)) is eligible


@pytest.mark.parametrize("params", [{"prompt_logprobs": 1}, {"extra_args": {"kv_transfer_params": {}}},
                                    {"repetition_penalty": 1.3}])
def test_prompt_logprobs_kv_transfer_and_repetition_penalty_are_not_eligible(params):
    # A repetition penalty also penalises prompt tokens, which the workers would not see.
    assert not relay_eligible(ecr("r", SYS + OWN, **params))


def test_startup_fill_makes_prompt_ready(core):
    relay = relay_of(core)
    assert core.relay_system_prompts() == [
        {"name": "sys", "slot": 0, "state": "ready", "tokens": 40, "refcount": 0, "generation": 1,
         "error": None}]
    # The fill computes the prompt's whole blocks, what relay requests read (the rest they compute).
    assert relay.counters.fills_completed == 1 and relay.counters.fill_tokens == 32  # its two whole blocks
    assert not core.scheduler.requests  # the fill finished and left


def test_matching_request_is_rewritten(core):
    sent = ecr("r1", SYS + OWN, max_tokens=10_000, salt="user", extra_args={"mine": 1})
    req = submit(core, sent)
    assert req.prompt_token_ids == KEPT + OWN and req.num_prompt_tokens == len(KEPT + OWN)
    tag = {"slot": 0, "system_len": SHARED, "fill": False}
    assert req.sampling_params.extra_args == {"mine": 1, TAG_KEY: tag}
    assert read_tag(req.sampling_params).system_len == SHARED
    assert req.cache_salt == f"vllm-relay:{relay_of(core).secret}:relay:sys:1:user"
    assert req.max_tokens == MAX_MODEL_LEN - len(SYS + OWN)  # stops where the full prompt would
    # The request as sent (the front end's copy, in-process) is untouched.
    assert sent.prompt_token_ids == SYS + OWN and sent.sampling_params.extra_args == {"mine": 1}
    assert sent.cache_salt == "user" and sent.sampling_params.max_tokens == 10_000
    assert core.relay_stats()["relay_requests"] == 1 and core.relay_system_prompts()[0]["refcount"] == 1


def test_other_requests_run_unchanged(core):
    plain = submit(core, ecr("plain", [1, 2, 3] + SYS))
    exact = submit(core, ecr("exact", SYS))  # no own token left: not routed
    logprobs = submit(core, ecr("lp", SYS + OWN, prompt_logprobs=1))
    forged_tag = {"slot": 0, "system_len": 9, "fill": True}
    forged = submit(core, ecr("forged", [1, 2], extra_args={TAG_KEY: forged_tag}))
    for req, ids in ((plain, [1, 2, 3] + SYS), (exact, SYS), (logprobs, SYS + OWN), (forged, [1, 2])):
        assert req.prompt_token_ids == ids and read_tag(req.sampling_params) is None
        assert req.cache_salt is None and getattr(req, INFO_ATTR, None) is None
    assert core.relay_stats()["relay_requests"] == 0 and core.relay_system_prompts()[0]["refcount"] == 0


def test_release_on_finish_and_abort_and_counters(core):
    submit(core, ecr("short", SYS + OWN, max_tokens=1))
    submit(core, ecr("long", SYS + [3, 4], max_tokens=100))
    submit(core, ecr("plain", [1, 2, 3], max_tokens=100))
    outputs = run_until_idle_or(core, lambda: "short" not in core.scheduler.requests)
    prompt = core.relay_system_prompts()[0]
    assert prompt["refcount"] == 1  # "long" still runs
    core.abort_requests(["long"])
    assert core.relay_system_prompts()[0]["refcount"] == 0
    core.relay_unregister_system_prompt("sys")  # nobody holds it any more
    stats = core.relay_stats()
    assert stats["relay_requests"] == 2 and stats["system_tokens_reused"] == 2 * SHARED
    # Prefill of both suffixes, then one decode token per step for "long" until the abort.
    decode_steps = len(outputs) - 1
    assert stats["relay_tokens"] == len(KEPT + OWN) + len(KEPT) + 2 + decode_steps
    # The client sees the full prompt: the system part counts as cached prompt tokens.
    first = {o.request_id: o.prefill_stats for eco in outputs[0].values() for o in eco.outputs}
    assert first["short"].num_prompt_tokens == len(SYS + OWN) and first["short"].num_cached_tokens >= SHARED
    assert first["plain"].num_prompt_tokens == 3 and first["plain"].num_cached_tokens == 0


def run_until_idle_or(core, done, max_steps=50):
    outputs = []
    while not done():
        outputs.append(step(core))
        assert len(outputs) < max_steps
    return outputs


def test_resume_after_preemption_counts_system_tokens_again(core):
    req = submit(core, ecr("r", SYS + OWN, max_tokens=50))
    step(core)
    sched = core.scheduler
    sched.running.remove(req)
    sched._preempt_request(req, 0.0)  # recompute: back to zero computed tokens
    step(core)
    assert core.relay_stats()["system_tokens_reused"] == 2 * SHARED


def test_same_prefix_different_salts_share_no_blocks(core):
    a, b = submit(core, ecr("a", SYS + OWN * 4)), submit(core, ecr("b", SYS + OWN * 4))
    c = submit(core, ecr("c", OWN * 4 + [1]))  # an ordinary request with a's suffix as its prompt
    assert a.block_hashes == b.block_hashes and a.block_hashes[0] != c.block_hashes[0]


def test_fill_blocks_become_the_prompts_pages_until_it_is_removed(core):
    """The fill's whole blocks stay allocated (not in the free pool) while the prompt owns its slot,
    and go back to the pool when it is unregistered."""
    pool = core.scheduler.kv_cache_manager.block_pool
    kept = relay_of(core).pages._kept
    (prompt, blocks), = kept.items()
    assert prompt is relay_of(core).registry.get("sys") and len(blocks) == SHARED // 16
    assert all(b.ref_cnt == 1 for b in blocks)  # held by relay alone: the fill request has left
    free_before = pool.get_num_free_blocks()
    core.relay_unregister_system_prompt("sys")
    assert not kept and all(b.ref_cnt == 0 for b in blocks)
    assert pool.get_num_free_blocks() == free_before + len(blocks)


# ---- run-time registration, holding ------------------------------------------------------------

RT = [200 + i for i in range(20)]


def test_runtime_fill_holds_matching_requests(core):
    state = core.relay_register_system_prompt("rt", RT)
    assert state == {"name": "rt", "slot": 1, "state": "filling", "tokens": 20, "refcount": 0,
                     "generation": 2, "error": None}
    assert core.relay_register_system_prompt("rt", RT)["state"] == "filling"  # idempotent: one fill
    held = submit(core, ecr("held", RT + OWN))
    dropped = submit(core, ecr("dropped", RT + OWN))
    assert "held" not in core.scheduler.requests and core.relay_stats()["held_requests"] == 2
    core.abort_requests(["dropped"])
    outputs = run_until_idle_or(core, lambda: "held" in core.scheduler.requests)
    assert all(o.request_id != fill_request_id(relay_of(core).registry.get("rt"))
               for out in outputs for eco in out.values() for o in eco.outputs)
    assert core.relay_system_prompts()[1] == {**state, "state": "ready", "refcount": 1}
    assert read_tag(held.sampling_params).slot == 1 and held.prompt_token_ids == RT[16:] + OWN
    assert "dropped" not in core.scheduler.requests and core.relay_stats()["held_requests"] == 0


def test_held_request_runs_unrouted_when_fill_fails(core):
    core.relay_register_system_prompt("rt", RT)
    submit(core, ecr("held", RT + OWN))
    core.abort_requests([fill_request_id(relay_of(core).registry.get("rt"))])
    req = core.scheduler.requests["held"]
    assert req.prompt_token_ids == RT + OWN and read_tag(req.sampling_params) is None
    assert [(p["name"], p["state"], p["slot"]) for p in core.relay_system_prompts()] == [
        ("sys", "ready", 0), ("rt", "failed", None)]
    assert "aborted" in core.relay_system_prompts()[1]["error"]
    assert core.relay_stats()["fills_failed"] == 1


def test_longer_filling_prompt_is_waited_for(core):
    longer = SYS + list(range(300, 310))  # 50 tokens: 48 shared
    core.relay_register_system_prompt("longer", longer)
    submit(core, ecr("r", longer + OWN))
    assert core.relay_system_prompts()[0]["refcount"] == 0  # not run now with the shorter "sys"
    run_until_idle_or(core, lambda: "r" in core.scheduler.requests)
    tag = read_tag(core.scheduler.requests["r"].sampling_params)
    assert tag.system_len == 48 and tag.slot == relay_of(core).registry.get("longer").slot


@pytest.mark.parametrize("name, prompt, match", [
    ("e", [], "empty token ids"),
    ("big", list(range(65)), "65 tokens, more than max_prompt_tokens=64"),
    ("third", list(range(1, 17)), "no free slot"),
    ("tiny", list(range(1, 16)), "15 tokens, fewer than one KV cache block"),
    ("t", "some text", "no tokenizer"),
    ("c", {"chat": "x"}, "a dict prompt must be"),
])
def test_register_errors(core, name, prompt, match):
    core.relay_register_system_prompt("rt", RT)
    with pytest.raises(ValueError, match=match):
        core.relay_register_system_prompt(name, prompt)


def test_startup_errors_fail_start(model_path):
    with pytest.raises(ValueError, match="leave no room"):
        make_core(model_path, relay={"max_prompt_tokens": 1024, "system_prompts": {"s": [1] * MAX_MODEL_LEN}})


def test_text_and_chat_prompts_use_the_model_tokenizer(model_path):
    from transformers import AutoTokenizer

    from vllm_relay.testing.tokenizer import SYSTEM_MESSAGE, SYSTEM_MESSAGE_TOKENS

    text_prompt = "You are a helpful assistant. Answer briefly and politely, in plain English."
    prompts = {"text": text_prompt, "chat": {"chat_system": SYSTEM_MESSAGE}}
    core = make_core(model_path, tokenizer=True, relay={"max_prompt_tokens": 128, "system_prompts": prompts})
    tok = AutoTokenizer.from_pretrained(model_path)
    text, chat = relay_of(core).registry.get("text"), relay_of(core).registry.get("chat")
    assert list(text.token_ids) == tok.encode(text_prompt) and text.token_ids[0] == tok.bos_token_id
    rendered = tok.apply_chat_template([{"role": "system", "content": SYSTEM_MESSAGE},
                                        {"role": "user", "content": "Any question at all"}], tokenize=False)
    ids = tok.encode(rendered, add_special_tokens=False)
    # <s> <|system|> \n ...system... <|end|> \n <|user|> \n: the system turn and the user header.
    assert chat.num_tokens == SYSTEM_MESSAGE_TOKENS + 7 and list(chat.token_ids) == ids[: chat.num_tokens]
    assert read_tag(submit(core, ecr("r", ids)).sampling_params).slot == chat.slot


def test_without_relay_the_hooks_run_vllm_code(model_path):
    core = make_core(model_path, backend=None)
    assert not hasattr(core, ENGINE_ATTR) and not hasattr(core.scheduler, ENGINE_ATTR)
    req = submit(core, ecr("r", SYS + OWN, extra_args={TAG_KEY: {"slot": 0, "system_len": 1, "fill": False}}))
    assert req.prompt_token_ids == SYS + OWN and read_tag(req.sampling_params) is not None  # untouched
    run_until_idle(core)


def test_summary_logged_only_when_changed(core, monkeypatch):
    from vllm_relay.engine import core as engine_state

    lines = []

    class Logger:
        def info(self, fmt, *args):
            lines.append(fmt % args)

    monkeypatch.setattr(engine_state, "_logger", Logger)
    relay = relay_of(core)
    relay.log_if_changed()
    assert lines == []  # start-up logged this state already
    submit(core, ecr("r", SYS + OWN))
    relay.log_if_changed()
    relay.log_if_changed()
    assert len(lines) == 1 and "sys[slot 0, ready, 40 tok, 1 refs]; relay requests 1" in lines[0]


# ---- one real engine ---------------------------------------------------------------------------


@pytest.mark.engine
def test_relay_engine_end_to_end(tmp_path):
    """vllm.LLM with relay: prompts ready when LLM() returns, routing, counters, usage, run-time
    registration. Outputs are not checked here (the workers' side is tested elsewhere)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from vllm_relay.testing.tokenizer import SYSTEM_MESSAGE_TOKENS

    script = Path(__file__).with_name("run_engine_hooks.py")
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(script), get_model("tiny-llama-gqa"), str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    chat_len = SYSTEM_MESSAGE_TOKENS + 7
    shared_chat = chat_len - chat_len % 32  # whole blocks (the engine runs blocks of 32)
    assert r["prompts_at_start"] == [
        {"name": "sys", "slot": 0, "state": "ready", "tokens": 40, "refcount": 0, "generation": 1, "error": None},
        {"name": "chat", "slot": 1, "state": "ready", "tokens": chat_len, "refcount": 0, "generation": 2,
         "error": None},
    ]
    assert "vllm-relay: system prompts ready" in proc.stdout + proc.stderr
    g = r["stats_generate"]
    assert g["relay_requests"] == 1 and g["system_tokens_reused"] == SHARED and g["fills_completed"] == 2
    assert g["relay_tokens"] >= 5 and g["held_requests"] == 0
    assert r["prompt_lens"] == [45, 15] and r["output_lens"] == [4, 4]  # usage: the full prompt
    assert r["cached_tokens"][0] >= SHARED and r["cached_tokens"][1] == 0
    assert r["registered"]["name"] == "rt" and r["registered"]["state"] == "ready"
    s = r["stats_runtime"]
    assert s["relay_requests"] == 2 and s["system_tokens_reused"] == SHARED + 32 and s["fills_completed"] == 3
    c = r["stats_chat"]
    assert c["relay_requests"] == 3 and c["system_tokens_reused"] == SHARED + 32 + shared_chat
    assert r["chat_prompt_len"] > chat_len
    assert "empty token ids" in r["register_error"]
