"""Every row of docs/errors.md's table of checked input, each through the path a user's input takes.

Configuration and start-up prompts: `EngineArgs.create_engine_config`, which every front end
calls before it starts an engine (hooks/frontend.py runs vllm_relay.validate there). Run-time
registration: the engine core's utility calls, on a real scheduler. Engine and model features:
the worker-side checks. The last test keeps the table and these tests in step.
"""

import json
import re
import shutil
from pathlib import Path

import pytest

from vllm_relay import envs
from vllm_relay.testing.models import get_model
from vllm_relay.testing.tokenizer import SYSTEM_MESSAGE

ERRORS_DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"
BASE = {"max_prompts": 2, "max_prompt_tokens": 256}
IDS_300 = list(range(1, 301))

# (relay section, env, engine args, error excerpt). A relay section that is a dict is merged over
# BASE; an env value starting with "file:" names a prompts file holding the rest.
FRONT_END = [
    ([1], {}, {}, 'additional_config["relay"]: must be a dict, got list'),
    ({"max_prompt": 4}, {}, {}, "unknown keys ['max_prompt']; valid keys are"),
    ({"max_prompts": 0}, {}, {}, "RelayConfig.max_prompts=0: must be an int >= 1"),
    ({"max_prompt_tokens": 0}, {}, {}, "RelayConfig.max_prompt_tokens=0: must be an int >= 1"),
    ({"shared_path": "sometimes"}, {}, {},
     "RelayConfig.shared_path='sometimes': must be one of ['auto', 'always', 'never']"),
    ({"log_stats_interval_s": -1}, {}, {}, "RelayConfig.log_stats_interval_s=-1: must be a finite number >= 0"),
    ({"admin_routes": "yes"}, {}, {}, "RelayConfig.admin_routes='yes': must be true or false"),
    ({"auto_levels": "off"}, {}, {}, "RelayConfig.auto_levels='off': must be true or false"),
    ({"metrics_interval_s": 0}, {}, {}, "RelayConfig.metrics_interval_s=0: must be a finite number > 0"),
    ({"system_prompts": ["hi"]}, {}, {}, "RelayConfig.system_prompts: must be a dict name -> text"),
    ({"system_prompts": {"a": [1], "b": [2], "c": [3]}}, {}, {}, "3 prompts (a, b, c), more than max_prompts=2"),
    ({"system_prompts": {"my prompt": [1]}}, {}, {},
     "system prompt name 'my prompt': allowed characters are [A-Za-z0-9_.-]"),
    ({"system_prompts": {"x" * 65: [1]}}, {}, {}, "characters, more than 64"),
    ({"system_prompts": {"a": ""}}, {}, {}, "empty text (a system prompt needs at least 1 token)"),
    ({"system_prompts": {"a": {"chat": "hi"}}}, {}, {},
     "a dict prompt must be {'chat_system': text}, got keys ['chat']"),
    ({"system_prompts": {"a": {"chat_system": ""}}}, {}, {}, "'chat_system' must be a non-empty string, got ''"),
    ({"system_prompts": {"a": 5}}, {}, {}, "token ids must be a sequence of ints, got int"),
    ({"system_prompts": {"a": []}}, {}, {}, "empty token ids (a system prompt needs at least 1 token)"),
    ({"system_prompts": {"a": [1, -2]}}, {}, {}, "token id -2 is not a non-negative int"),
    ({"system_prompts": {"a": IDS_300}}, {}, {}, "300 tokens, more than max_prompt_tokens=256"),
    ({}, {"VLLM_RELAY_SYSTEM_PROMPTS_FILE": "/missing/prompts.json"}, {},
     "cannot read it: No such file or directory"),
    ({}, {"VLLM_RELAY_SYSTEM_PROMPTS_FILE": "file:{name: 1"}, {}, "not valid JSON"),
    ({}, {"VLLM_RELAY_SYSTEM_PROMPTS_FILE": "file:[1, 2]"}, {}, "must hold a JSON object {name: text"),
    ({}, {"VLLM_RELAY_UNSPLIT_GRAPHS": "3"}, {},
     "VLLM_RELAY_UNSPLIT_GRAPHS='3': expected one of 0 (the split graph with levels only)"),
    ({}, {"VLLM_RELAY_VERIFY_GRAPHS": "yes"}, {},
     "VLLM_RELAY_VERIFY_GRAPHS='yes': expected one of 0 (vLLM's graphs for decodes verifying drafts)"),
    ({}, {"VLLM_RELAY_CACHE": "file:{}"}, {}, "prompts.json': not a folder"),
    ({}, {"VLLM_RELAY_MAX_PROMPTS": "4"}, {},
     "VLLM_RELAY_MAX_PROMPTS is no longer read by vllm-relay: set max_prompts in the relay section"),
    ({}, {"VLLM_RELAY_JOINT": "0"}, {}, "VLLM_RELAY_JOINT is no longer read by vllm-relay: a tuning knob"),
    ({"system_prompts": {"a": "word " * 400}}, {}, {},
     "system prompt 'a': 402 tokens, more than max_prompt_tokens=256"),
    ({"system_prompts": {"a": {"chat_system": "word " * 300}}}, {}, {},
     "system prompt 'a': 308 tokens, more than max_prompt_tokens=256"),
    ({"system_prompts": {"a": "hi"}}, {}, {"skip_tokenizer_init": True},
     "given as text, but the engine has no tokenizer (skip_tokenizer_init); give token ids instead"),
    ({"system_prompts": {"a": {"chat_system": "hi"}}}, {}, {"model": "no-chat-template"},
     "the model's chat template cannot render it"),
    ({"system_prompts": {"a": [1, 5000]}}, {}, {}, "token id 5000 is out of the model's vocabulary (size 3072)"),
    ({"system_prompts": {"a": list(range(1, 16))}}, {}, {},
     "15 tokens, fewer than one KV cache block (16 tokens): relay shares whole blocks"),
    ({"system_prompts": {"a": list(range(1, 65))}}, {}, {"max_model_len": 64},
     "64 tokens leave no room for a request's own tokens within max_model_len=64"),
    ({}, {}, {"scheduler_cls": "my_pkg.MyScheduler"},
     "scheduler_cls='my_pkg.MyScheduler': the relay attention backend runs its own scheduler"),
]

REGISTRATION = [
    ("slots", "no free slot, all max_prompts=2 are taken by ['sys', 'rt']; unregister one first"),
    ("reregister", "cannot re-register it with different tokens: system prompt 'rt' is filling"),
    ("unregister-unknown", "no system prompt named 'nope'; registered: ['sys']"),
    ("unregister-held", "cannot unregister it: system prompt 'sys' is held by 1 request(s)"),
]
FILL_FAILED = "system prompt 'rt' failed to fill: its fill request was aborted"
ENGINE_FEATURES = "The relay attention backend does not support: speculative decoding"
MODEL_FEATURES = "The relay attention backend (cpu) does not support: ALiBi"
XARGS = "not an error: dropped, with a warning (only the engine core tags requests)"

DRAFTER_BACKEND = "speculative_config.attention_backend=CPU_ATTN: with the relay attention backend the drafter's"
RUNNER_ERROR = "VLLM_USE_V2_MODEL_RUNNER=0: the relay attention backend runs on vLLM's Model Runner V2 on GPUs"
MLA_ERROR = ("MLA (multi-head latent attention, DeepSeek-V2/V3's) on the CPU: the relay attention backend extends "
             "vLLM's CPU attention backend, not its MLA one")
ALL_ERRORS = [row[-1] for row in FRONT_END] + [e for _, e in REGISTRATION] + [
    FILL_FAILED, ENGINE_FEATURES, MODEL_FEATURES, XARGS, RUNNER_ERROR, DRAFTER_BACKEND, MLA_ERROR]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in envs.environment_variables:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def no_chat_template_model(tmp_path_factory):
    """A copy of the tiny model whose tokenizer has no chat template."""
    path = tmp_path_factory.mktemp("models") / "no-chat-template"
    shutil.copytree(get_model("tiny-llama-gqa"), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return str(path)


def engine_args(relay, **engine):
    from vllm.engine.arg_utils import EngineArgs

    import vllm_relay

    vllm_relay.register()
    section = {**BASE, **relay} if isinstance(relay, dict) else relay
    kwargs = {"model": get_model("tiny-llama-gqa"), "attention_backend": "relay", "max_model_len": 512,
              "block_size": 16, "additional_config": {"relay": section}, **engine}
    return EngineArgs(**kwargs)


@pytest.mark.parametrize("relay, env, engine, error", FRONT_END, ids=[row[-1][:40] for row in FRONT_END])
def test_front_end_rejects(relay, env, engine, error, monkeypatch, tmp_path, no_chat_template_model):
    for name, value in env.items():
        if value.startswith("file:"):
            (tmp_path / "prompts.json").write_text(value[5:])
            value = str(tmp_path / "prompts.json")
        monkeypatch.setenv(name, value)
    if engine.get("model") == "no-chat-template":
        engine = {**engine, "model": no_chat_template_model}
    with pytest.raises(ValueError, match=re.escape(error)):
        engine_args(relay, **engine).create_engine_config()


def test_front_end_accepts_a_good_configuration_and_ignores_relay_settings_without_relay():
    text = "You are a helpful assistant. Answer briefly and politely, in plain English."
    good = {"system_prompts": {"a": text, "b": {"chat_system": SYSTEM_MESSAGE}}}
    config = engine_args(good).create_engine_config()
    assert config.additional_config["relay"]["system_prompts"]["a"] == text
    engine_args({"max_prompts": 0}, attention_backend=None).create_engine_config()  # relay not selected


# ---- run-time registration (engine core) -------------------------------------------------------


@pytest.fixture
def core():
    from tests.engine.test_core import SYS, make_core

    return make_core(str(get_model("tiny-llama-gqa")), relay={"system_prompts": {"sys": SYS}})


@pytest.mark.parametrize("case, error", REGISTRATION, ids=[c for c, _ in REGISTRATION])
def test_registration_rejects(core, case, error):
    from tests.engine.test_core import OWN, RT, SYS, ecr, submit

    if case in ("slots", "reregister"):
        core.relay_register_system_prompt("rt", RT)  # filling
    if case == "unregister-held":
        submit(core, ecr("r", SYS + OWN))  # holds "sys"
    with pytest.raises(ValueError, match=re.escape(error)):
        if case == "slots":
            core.relay_register_system_prompt("third", list(range(1, 17)))
        elif case == "reregister":
            core.relay_register_system_prompt("rt", RT[:-1])
        elif case == "unregister-unknown":
            core.relay_unregister_system_prompt("nope")
        else:
            core.relay_unregister_system_prompt("sys")


def test_failed_fill_is_listed_with_its_reason_and_raised_to_waiters(core):
    from vllm.v1.engine.core import EngineCore

    from tests.engine.test_core import RT
    from vllm_relay.stats import _find

    state = core.relay_register_system_prompt("rt", RT)
    EngineCore.pause_scheduler(core, mode="abort", clear_cache=False)
    listed = core.relay_system_prompts()
    assert listed[1]["state"] == "failed" and listed[1]["error"].startswith("its fill request was aborted")
    with pytest.raises(RuntimeError, match=re.escape(FILL_FAILED)):
        _find("rt", listed, state)  # what register_system_prompt(wait=True) does with it


# ---- engine and model features (worker start-up) -----------------------------------------------


@pytest.mark.parametrize("feature", ["speculative", "xdrope", "kv_cache_dtype"])
def test_engine_features_are_refused(feature, monkeypatch):
    from vllm.config import ModelConfig, set_current_vllm_config

    from vllm_relay.attention.common import check_engine

    engine = {}
    if feature == "speculative":
        engine["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    elif feature == "kv_cache_dtype":
        engine["kv_cache_dtype"] = "float16"  # neither the model's float32 nor FP8
    config = engine_args({}, **engine).create_engine_config()
    if feature == "speculative":  # a drafter model (EAGLE's) needs its weights to configure: named after
        config.speculative_config.method = "eagle"
    if feature == "xdrope":
        monkeypatch.setattr(ModelConfig, "uses_xdrope_dim", 1, raising=False)
    expected = {"speculative": ENGINE_FEATURES, "xdrope": "XD-RoPE position encodings",
                "kv_cache_dtype": "kv_cache_dtype='float16' other than the model's"}[feature]
    with set_current_vllm_config(config), pytest.raises(NotImplementedError, match=re.escape(expected)):
        check_engine()


def eagle3(tokens: int = 1) -> dict:
    return {"method": "eagle3", "model": get_model("tiny-llama-gqa-eagle3"), "num_speculative_tokens": tokens}


@pytest.mark.parametrize("case", ["method", "cuda", "cpu"])
def test_drafters_relay_cannot_serve_are_refused(case, monkeypatch):
    """Served: EAGLE-3 and MTP, any number of draft tokens a step (Model Runner V2's speculator on the GPU,
    the V1 runner on the CPU). Another drafter model is refused at start-up with the reason; on the GPU
    and on the CPU two draft tokens pass."""
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform

    from vllm_relay.attention.common import check_engine, drafter_unsupported

    config = engine_args({}, speculative_config=eagle3(2)).create_engine_config()
    if case == "method":  # a drafter model of another kind (EAGLE-1 heads need a model of their own to configure)
        config.speculative_config.method = "eagle"
    if case in ("cuda", "cpu"):
        monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: case == "cpu")
        assert drafter_unsupported(config.speculative_config) is None
        return
    expected = "speculative decoding with eagle drafts (served: n-gram, EAGLE-3 and MTP drafts)"
    with set_current_vllm_config(config), pytest.raises(NotImplementedError, match=re.escape(expected)):
        check_engine()


def test_an_eagle3_drafter_runs_on_relay_and_a_prompt_keeps_one_token_back():
    """With an EAGLE-3 drafter the front end puts the drafter's layers on relay, refuses another backend
    named for them, and wants a registered prompt one token longer than a KV block."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_relay.attention.common import check_engine

    config = engine_args({}, speculative_config=eagle3()).create_engine_config()
    assert config.speculative_config.attention_backend == AttentionBackendEnum.CUSTOM
    with set_current_vllm_config(config):
        check_engine()  # served
    other = {**eagle3(), "attention_backend": "CPU_ATTN"}
    with pytest.raises(ValueError, match=re.escape(DRAFTER_BACKEND)):
        engine_args({}, speculative_config=other).create_engine_config()
    short = {"system_prompts": {"a": list(range(1, 17))}}  # one block of 16, no token after it
    short_one = "fewer than one KV cache block (16 tokens, and one more with eagle3"
    with pytest.raises(ValueError, match=re.escape(short_one)):
        engine_args(short, speculative_config=eagle3()).create_engine_config()
    enough = {"system_prompts": {"a": list(range(1, 18))}}
    engine_args(enough, speculative_config=eagle3()).create_engine_config()


def test_mrope_is_accepted(monkeypatch):
    """Both backends shift M-RoPE positions (in every section)."""
    from vllm.config import ModelConfig, set_current_vllm_config

    from vllm_relay.attention.common import check_engine

    config = engine_args({}).create_engine_config()
    monkeypatch.setattr(ModelConfig, "uses_mrope", property(lambda self: True))
    assert config.model_config.uses_mrope
    with set_current_vllm_config(config):
        check_engine()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_kv_cache_is_accepted(kv_cache_dtype):
    """Both backends read an FP8 cache; which formats, each backend's `supports_kv_cache_dtype` says
    (the CPU's all three, FlashAttention-3's fp8 / fp8_e4m3)."""
    from vllm.config import set_current_vllm_config

    from vllm_relay.attention.common import check_engine

    config = engine_args({}, kv_cache_dtype=kv_cache_dtype).create_engine_config()
    with set_current_vllm_config(config):
        check_engine()


def test_ngram_speculative_decoding_is_accepted():
    """Both backends serve n-gram drafts (from the token ids, no drafter model)."""
    from vllm.config import set_current_vllm_config

    from vllm_relay.attention.common import check_engine

    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    config = engine_args({}, speculative_config=spec).create_engine_config()
    with set_current_vllm_config(config):
        check_engine()


def test_sleep_mode_is_accepted():
    """Sleep resets the prefix cache first: relay's refills bring the prompts back on wake-up."""
    from vllm.config import set_current_vllm_config

    from vllm_relay.attention.common import check_engine

    config = engine_args({}).create_engine_config()
    config.model_config.enable_sleep_mode = True  # vLLM refuses it on the CPU platform itself: set it after
    with set_current_vllm_config(config):
        check_engine()


@pytest.mark.parametrize("feature, value", [("alibi_slopes", [1.0]), ("attn_type", "encoder_only"),
                                            ("kv_sharing_target_layer_name", "model.layers.0.attn")])
def test_model_features_are_refused(feature, value):
    from vllm.v1.attention.backend import AttentionType

    from vllm_relay.attention.common import check_layer

    layer = {"alibi_slopes": None, "attn_type": AttentionType.DECODER, feature: value}
    with pytest.raises(NotImplementedError, match=r"The relay attention backend \(cpu\) does not support: "):
        check_layer("cpu", **layer)
    if feature == "alibi_slopes":
        with pytest.raises(NotImplementedError, match=re.escape(MODEL_FEATURES)):
            check_layer("cpu", **layer)
    check_layer("cpu", alibi_slopes=None, attn_type=AttentionType.DECODER)  # the same layer without it


def test_a_client_relay_tag_is_dropped_with_a_warning(core, monkeypatch):
    from tests.engine.test_core import ecr, submit
    from vllm_relay.engine import core as engine_core
    from vllm_relay.protocol import TAG_KEY, read_tag

    warnings = []

    class Logger:
        def warning_once(self, fmt, *args):
            warnings.append(fmt % args)

    monkeypatch.setattr(engine_core, "_logger", Logger)
    req = submit(core, ecr("r", [1, 2, 3], extra_args={TAG_KEY: {"slot": 0, "system_len": 9, "fill": True}}))
    assert read_tag(req.sampling_params) is None and len(warnings) == 1 and TAG_KEY in warnings[0]


def test_the_v1_runner_is_refused_on_gpus_in_the_front_end(monkeypatch):
    """A GPU engine forced onto vLLM's V1 runner is refused before it starts; the CPU's runner is not
    asked (this machine runs vLLM's CPU runner, a V1 subclass, and relay on it)."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from vllm_relay.validate import check_runner

    check_runner(SimpleNamespace(use_v2_model_runner=False))  # the CPU: fine
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    check_runner(SimpleNamespace(use_v2_model_runner=True))
    with pytest.raises(ValueError, match=re.escape(RUNNER_ERROR)):
        check_runner(SimpleNamespace(use_v2_model_runner=False))


def test_an_mla_model_is_refused_in_the_front_end():
    """DeepSeek-V2-Lite's shape (latent attention, dense MLPs; config only): vLLM builds its engine config,
    and with relay selected the front end refuses it, naming MLA, before any engine process starts
    (without the check the CPU's workers would fail once started, vLLM having turned prefix caching off)."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_relay.testing.models import get_model

    args = dict(model=get_model("deepseek-v2-lite-shape"), load_format="dummy", max_model_len=4096)
    assert EngineArgs(**args).create_engine_config().model_config.use_mla
    with pytest.raises(ValueError, match=re.escape(MLA_ERROR)):
        EngineArgs(**args, attention_backend="relay").create_engine_config()


def test_an_mla_model_on_cuda_goes_to_relays_mla_backend(monkeypatch):
    """On CUDA the front end lets an MLA model through (relay's MLA backend serves it, hooks/platform.py
    routes its layers there), on the CPU it refuses it; the switch that once gated the backend is refused
    by `envs.check`, saying to unset it."""
    from types import SimpleNamespace

    from vllm.platforms import current_platform

    from vllm_relay.validate import check_model

    config = SimpleNamespace(model_config=SimpleNamespace(use_mla=True))
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)
    with pytest.raises(ValueError, match=re.escape(MLA_ERROR)):
        check_model(config)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    check_model(config)
    monkeypatch.setenv("VLLM_RELAY_MLA", "1")
    with pytest.raises(ValueError, match="VLLM_RELAY_MLA is no longer read by vllm-relay: relay's MLA backend"):
        envs.check()


def test_readme_table_lists_every_tested_row():
    text = ERRORS_DOC.read_text()
    section = text[text.index("## Every checked input"):]
    section = section[: section.index("\n## ", 1)]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| input")]
    assert len(rows) == len(ALL_ERRORS), (len(rows), len(ALL_ERRORS))
    for error in ALL_ERRORS:
        assert sum(error in row for row in rows) >= 1, f"docs/errors.md's table lacks: {error}"
