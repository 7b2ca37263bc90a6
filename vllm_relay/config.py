"""`RelayConfig`: the plugin's one configuration surface.

Sources: the dataclass defaults, then `--additional-config '{"relay": {...}}'`, whose keys are the
one way to set the fields; the prompts file named by `VLLM_RELAY_SYSTEM_PROMPTS_FILE` (`envs.py`)
adds to `system_prompts`, its entries winning on a name clash. Everything is validated in
`__post_init__`, so a bad value fails at start-up with a message naming the field, its value and
the limit, instead of as a shape error inside a kernel.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from vllm_relay import envs

# How decode tokens read what they share (see vllm_relay/ops/level_tree.py and attention/planner.py):
# "auto" lets the measured rule pick per step; "always" makes every shared run a level (one grouped
# read for the requests under it), "never" none (each request reads everything itself: the prefix
# path), for tests and benchmarks.
SHARED_PATHS = ("auto", "always", "never")

# Prompt names appear in logs, metrics labels and URLs, so keep them short and plain.
MAX_PROMPT_NAME_LEN = 64
PROMPT_NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")

# The key of the plugin's section in vLLM's `additional_config`.
ADDITIONAL_CONFIG_KEY = "relay"


def check_prompt_name(name: object) -> str:
    """Return `name` if it is a valid system-prompt name, else raise ValueError saying why."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"system prompt name {name!r}: must be a non-empty string")
    if len(name) > MAX_PROMPT_NAME_LEN:
        raise ValueError(
            f"system prompt name {name!r}: {len(name)} characters, more than {MAX_PROMPT_NAME_LEN}"
        )
    if not PROMPT_NAME_PATTERN.fullmatch(name):
        raise ValueError(f"system prompt name {name!r}: allowed characters are [A-Za-z0-9_.-]")
    return name


def check_token_ids(what: str, token_ids: object, max_tokens: int) -> list[int]:
    """Return `token_ids` as a fresh list if it is 1..max_tokens non-negative ints, else raise."""
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
        raise ValueError(f"{what}: token ids must be a sequence of ints, got {type(token_ids).__name__}")
    ids = list(token_ids)  # type: ignore[call-overload]
    if not ids:
        raise ValueError(f"{what}: empty token ids (a system prompt needs at least 1 token)")
    if len(ids) > max_tokens:
        raise ValueError(f"{what}: {len(ids)} tokens, more than max_prompt_tokens={max_tokens}")
    bad = next((t for t in ids if isinstance(t, bool) or not isinstance(t, int) or t < 0), None)
    if bad is not None:
        raise ValueError(f"{what}: token id {bad!r} is not a non-negative int")
    return ids


# The one dict form of a system prompt: {"chat_system": text} means "the system message as the
# model's chat template renders it" (the engine renders the template to find those tokens).
CHAT_SYSTEM_KEY = "chat_system"


def check_prompt_spec(what: str, prompt: object, max_tokens: int) -> str | list[int] | dict[str, str]:
    """Return a system prompt as given (text, token ids or {"chat_system": text}), checked and
    copied, else raise ValueError naming `what`. Text lengths are checked once tokenized."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{what}: empty text (a system prompt needs at least 1 token)")
        return prompt
    if isinstance(prompt, Mapping):
        if set(prompt) != {CHAT_SYSTEM_KEY}:
            raise ValueError(
                f"{what}: a dict prompt must be {{{CHAT_SYSTEM_KEY!r}: text}}, "
                f"got keys {sorted(map(str, prompt))}"
            )
        text = prompt[CHAT_SYSTEM_KEY]
        if not isinstance(text, str) or not text:
            raise ValueError(f"{what}: {CHAT_SYSTEM_KEY!r} must be a non-empty string, got {text!r}")
        return {CHAT_SYSTEM_KEY: text}
    return check_token_ids(what, prompt, max_tokens)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(slots=True)
class RelayConfig:
    """How many system prompts, how long, which ones at start-up, and how relay runs them."""

    # Slots: system prompts resident at once. Each one's KV lives in pages of vLLM's paged KV
    # cache (its whole blocks), taken when it is filled and given back when it is removed.
    max_prompts: int = 2
    # Most tokens of one system prompt.
    max_prompt_tokens: int = 8192
    # Prompts given at start-up: name -> text (tokenized by the engine as a completion prompt),
    # token ids, or {"chat_system": text} (the system message as the chat template renders it).
    system_prompts: dict[str, str | list[int] | dict[str, str]] = field(default_factory=dict)
    # Seconds between stats log lines; 0 turns them off.
    log_stats_interval_s: float = 10.0
    # "auto" (the measured rule), "always" or "never": see SHARED_PATHS. It governs every shared
    # level: "never" leaves each request's attention one call over its own table (and system pages).
    shared_path: str = "auto"
    # Also share what nobody registered: runs of KV blocks that several decode requests' block tables
    # hold (vLLM's prefix cache: the n samples of a prompt, requests over one document, a common
    # history), found each step as a tree under the system prompts. False: registered prompts only.
    auto_levels: bool = True
    # The OpenAI server's relay endpoints (vllm_relay.entrypoints, loaded with VLLM_PLUGINS=relay):
    # False leaves only the read-only GET routes (no registering or deleting prompts over HTTP).
    admin_routes: bool = True
    # Seconds between the server's reads of the engine core's counters for its /metrics series.
    metrics_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if not _is_int(self.max_prompts) or self.max_prompts < 1:
            raise ValueError(f"RelayConfig.max_prompts={self.max_prompts!r}: must be an int >= 1")
        if not _is_int(self.max_prompt_tokens) or self.max_prompt_tokens < 1:
            raise ValueError(
                f"RelayConfig.max_prompt_tokens={self.max_prompt_tokens!r}: must be an int >= 1"
            )
        if self.shared_path not in SHARED_PATHS:
            raise ValueError(
                f"RelayConfig.shared_path={self.shared_path!r}: must be one of {list(SHARED_PATHS)}"
            )
        interval = self.log_stats_interval_s
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not (
            math.isfinite(interval) and interval >= 0
        ):
            raise ValueError(
                f"RelayConfig.log_stats_interval_s={interval!r}: must be a finite number >= 0"
            )
        self.log_stats_interval_s = float(interval)
        if not isinstance(self.admin_routes, bool):
            raise ValueError(f"RelayConfig.admin_routes={self.admin_routes!r}: must be true or false")
        if not isinstance(self.auto_levels, bool):
            raise ValueError(f"RelayConfig.auto_levels={self.auto_levels!r}: must be true or false")
        interval = self.metrics_interval_s
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not (
            math.isfinite(interval) and interval > 0
        ):
            raise ValueError(f"RelayConfig.metrics_interval_s={interval!r}: must be a finite number > 0")
        self.metrics_interval_s = float(interval)
        self.system_prompts = self._checked_prompts(self.system_prompts)

    def _checked_prompts(self, prompts: object) -> dict[str, str | list[int] | dict[str, str]]:
        if not isinstance(prompts, Mapping):
            raise ValueError(
                f"RelayConfig.system_prompts: must be a dict name -> text | token ids | "
                f'{{"{CHAT_SYSTEM_KEY}": text}}, got {type(prompts).__name__}'
            )
        if len(prompts) > self.max_prompts:
            raise ValueError(
                f"RelayConfig.system_prompts: {len(prompts)} prompts ({', '.join(map(str, prompts))}), "
                f"more than max_prompts={self.max_prompts}"
            )
        checked: dict[str, str | list[int] | dict[str, str]] = {}
        for name, prompt in prompts.items():
            try:
                check_prompt_name(name)
            except ValueError as e:
                raise ValueError(f"RelayConfig.system_prompts: {e}") from None
            what = f"RelayConfig.system_prompts[{name!r}]"
            checked[name] = check_prompt_spec(what, prompt, self.max_prompt_tokens)
        return checked

    @classmethod
    def from_vllm(cls, additional_config: Mapping[str, Any] | None) -> RelayConfig:
        """Build from vLLM's `additional_config` (its "relay" section), with the prompts file of
        `VLLM_RELAY_SYSTEM_PROMPTS_FILE` merged into its `system_prompts`.

        Unknown keys are an error rather than ignored: a typo such as "max_prompt" would
        otherwise silently leave the default in place.
        """
        section = (additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
        if section is None:
            section = {}
        if not isinstance(section, Mapping):
            raise ValueError(
                f'additional_config["{ADDITIONAL_CONFIG_KEY}"]: must be a dict, '
                f"got {type(section).__name__}"
            )
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(section) - set(valid))
        if unknown:
            raise ValueError(
                f'additional_config["{ADDITIONAL_CONFIG_KEY}"]: unknown keys {unknown}; '
                f"valid keys are {valid}"
            )
        kwargs = dict(section)
        if (path := envs.VLLM_RELAY_SYSTEM_PROMPTS_FILE) is not None:
            prompts = kwargs.get("system_prompts") or {}
            if not isinstance(prompts, Mapping):
                raise ValueError(
                    f"RelayConfig.system_prompts: must be a dict name -> text | token ids, "
                    f"got {type(prompts).__name__}"
                )
            kwargs["system_prompts"] = {**prompts, **load_prompts_file(path)}
        return cls(**kwargs)


def load_prompts_file(path: str | Path) -> dict[str, Any]:
    """Read a JSON file {name: text | [token ids] | {"chat_system": text}}; values are validated
    by RelayConfig."""
    where = f"VLLM_RELAY_SYSTEM_PROMPTS_FILE={str(path)!r}"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{where}: cannot read it: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must hold a JSON object {{name: text | [token ids]}}")
    return data
