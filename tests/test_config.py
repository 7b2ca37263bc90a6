"""RelayConfig validation, from_vllm, the prompts file and envs.py. CPU only, no vLLM needed."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_relay import envs
from vllm_relay.config import MAX_PROMPT_NAME_LEN, RelayConfig, check_prompt_name

REPO = Path(__file__).resolve().parents[1]
RELAY_ENV = list(envs.environment_variables)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in RELAY_ENV:
        monkeypatch.delenv(name, raising=False)


def test_defaults():
    c = RelayConfig()
    assert (c.max_prompts, c.max_prompt_tokens, c.shared_path) == (2, 8192, "auto")
    assert c.system_prompts == {} and c.log_stats_interval_s == 10.0
    assert c.admin_routes is True and c.metrics_interval_s == 1.0 and c.auto_levels is True


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_prompts": 0}, r"max_prompts=0: must be an int >= 1"),
        ({"max_prompts": True}, r"max_prompts=True"),
        ({"max_prompts": "2"}, r"max_prompts='2'"),
        ({"max_prompt_tokens": 0}, r"max_prompt_tokens=0: must be an int >= 1"),
        ({"max_prompt_tokens": 1.5}, r"max_prompt_tokens=1.5: must be an int >= 1"),
        ({"shared_path": "sometimes"}, r"shared_path='sometimes': must be one of \['auto', 'always', 'never'\]"),
        ({"log_stats_interval_s": -1.0}, r"log_stats_interval_s=-1.0: must be a finite number >= 0"),
        ({"log_stats_interval_s": float("inf")}, r"log_stats_interval_s=inf"),
        ({"admin_routes": "no"}, r"admin_routes='no': must be true or false"),
        ({"auto_levels": 1}, r"auto_levels=1: must be true or false"),
        ({"metrics_interval_s": 0}, r"metrics_interval_s=0: must be a finite number > 0"),
        ({"metrics_interval_s": float("nan")}, r"metrics_interval_s=nan"),
    ],
)
def test_field_limits(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RelayConfig(**kwargs)


def test_valid_edges():
    RelayConfig(max_prompt_tokens=1, max_prompts=1)
    RelayConfig(max_prompt_tokens=1000, shared_path="never")
    assert RelayConfig(log_stats_interval_s=0).log_stats_interval_s == 0.0


@pytest.mark.parametrize(
    "prompts, match",
    [
        ({"": "hi"}, r"system prompt name '': must be a non-empty string"),
        (
            {"a" * (MAX_PROMPT_NAME_LEN + 1): "hi"},
            rf"{MAX_PROMPT_NAME_LEN + 1} characters, more than {MAX_PROMPT_NAME_LEN}",
        ),
        ({"a b": "hi"}, r"'a b': allowed characters are \[A-Za-z0-9_.-\]"),
        ({"ok": ""}, r"system_prompts\['ok'\]: empty text"),
        ({"ok": []}, r"system_prompts\['ok'\]: empty token ids"),
        ({"ok": [1, -2]}, r"token id -2 is not a non-negative int"),
        ({"ok": [1, 2.0]}, r"token id 2.0 is not"),
        ({"ok": 5}, r"token ids must be a sequence of ints, got int"),
        ({"ok": list(range(257))}, r"257 tokens, more than max_prompt_tokens=256"),
        ({"a": "x", "b": "y", "c": "z"}, r"3 prompts \(a, b, c\), more than max_prompts=2"),
    ],
)
def test_system_prompt_limits(prompts, match):
    with pytest.raises(ValueError, match=match):
        RelayConfig(max_prompt_tokens=256, system_prompts=prompts)


def test_system_prompts_not_a_dict():
    with pytest.raises(ValueError, match=r"system_prompts: must be a dict .* got list"):
        RelayConfig(system_prompts=["hi"])


def test_system_prompts_normalized_and_copied():
    ids = (1, 2, 3)
    c = RelayConfig(system_prompts={"chat-v1.2_x": "You are helpful.", "ids": ids})
    assert c.system_prompts == {"chat-v1.2_x": "You are helpful.", "ids": [1, 2, 3]}
    check_prompt_name("a" * MAX_PROMPT_NAME_LEN)


def test_from_vllm_empty():
    assert RelayConfig.from_vllm(None) == RelayConfig()
    assert RelayConfig.from_vllm({}) == RelayConfig()
    assert RelayConfig.from_vllm({"other_plugin": {"x": 1}}) == RelayConfig()
    assert RelayConfig.from_vllm({"relay": None}) == RelayConfig()


def test_from_vllm_reads_relay_section():
    section = {"max_prompts": 4, "shared_path": "always", "system_prompts": {"a": "x"}}
    c = RelayConfig.from_vllm({"relay": section})
    assert (c.max_prompts, c.shared_path, c.system_prompts) == (4, "always", {"a": "x"})


def test_from_vllm_unknown_keys():
    match = r"unknown keys \['max_prompt', 'zzz'\]; valid keys are \['max_prompts', 'max_prompt_tokens', "
    with pytest.raises(ValueError, match=match):
        RelayConfig.from_vllm({"relay": {"max_prompt": 4, "zzz": 1}})


def test_from_vllm_section_not_a_dict():
    with pytest.raises(ValueError, match=r'additional_config\["relay"\]: must be a dict, got list'):
        RelayConfig.from_vllm({"relay": [1]})
    with pytest.raises(ValueError, match=r"must be a dict, got list"):
        RelayConfig.from_vllm({"relay": []})


def test_prompts_file_empty_means_unset(monkeypatch):
    monkeypatch.setenv("VLLM_RELAY_SYSTEM_PROMPTS_FILE", "")
    assert envs.VLLM_RELAY_SYSTEM_PROMPTS_FILE is None and not envs.is_set("VLLM_RELAY_SYSTEM_PROMPTS_FILE")
    assert RelayConfig.from_vllm({"relay": {"system_prompts": {"a": "x"}}}).system_prompts == {"a": "x"}


def test_prompts_file_merged(monkeypatch, tmp_path):
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps({"b": [5, 6, 7], "a": "from file"}))
    monkeypatch.setenv("VLLM_RELAY_SYSTEM_PROMPTS_FILE", str(f))
    c = RelayConfig.from_vllm({"relay": {"max_prompts": 3, "system_prompts": {"a": "inline", "c": "z"}}})
    assert c.system_prompts == {"a": "from file", "b": [5, 6, 7], "c": "z"}


def test_prompts_file_counts_against_max_prompts(monkeypatch, tmp_path):
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps({"b": "y", "c": "z"}))
    monkeypatch.setenv("VLLM_RELAY_SYSTEM_PROMPTS_FILE", str(f))
    with pytest.raises(ValueError, match=r"3 prompts .* more than max_prompts=2"):
        RelayConfig.from_vllm({"relay": {"system_prompts": {"a": "x"}}})


@pytest.mark.parametrize(
    "content, match",
    [(None, r"cannot read it"), ("{not json", r"not valid JSON"), ("[1, 2]", r"must hold a JSON object")],
)
def test_prompts_file_errors(monkeypatch, tmp_path, content, match):
    f = tmp_path / "prompts.json"
    if content is not None:
        f.write_text(content)
    monkeypatch.setenv("VLLM_RELAY_SYSTEM_PROMPTS_FILE", str(f))
    with pytest.raises(ValueError, match=rf"VLLM_RELAY_SYSTEM_PROMPTS_FILE=.*prompts.json.*: {match}"):
        RelayConfig.from_vllm(None)


def test_envs_module():
    assert set(dir(envs)) == set(RELAY_ENV)
    assert all(name.startswith("VLLM_RELAY_") for name in RELAY_ENV)
    with pytest.raises(AttributeError):
        envs.VLLM_RELAY_NOPE  # noqa: B018
    with pytest.raises(AttributeError):
        envs.is_set("VLLM_RELAY_NOPE")


def test_only_envs_reads_the_environment():
    """Principle 6: os.getenv / os.environ appear in envs.py only (among the config modules)."""
    for rel in ["vllm_relay/config.py", "vllm_relay/system_prompts"]:
        path = REPO / rel
        for f in [path] if path.is_file() else sorted(path.rglob("*.py")):
            text = f.read_text()
            assert "os.getenv" not in text and "os.environ" not in text, f


def test_importable_without_vllm_or_torch():
    code = (
        "import sys; sys.modules['vllm'] = None; sys.modules['torch'] = None\n"
        "import vllm_relay.config, vllm_relay.envs, vllm_relay.system_prompts\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO)


def test_chat_system_prompts():
    c = RelayConfig(system_prompts={"chat": {"chat_system": "You are helpful."}})
    assert c.system_prompts == {"chat": {"chat_system": "You are helpful."}}
    with pytest.raises(ValueError, match=r"a dict prompt must be \{'chat_system': text\}, got keys \['x'\]"):
        RelayConfig(system_prompts={"c": {"x": "y"}})
    with pytest.raises(ValueError, match=r"\['c'\]: 'chat_system' must be a non-empty string, got ''"):
        RelayConfig(system_prompts={"c": {"chat_system": ""}})
