"""Every `VLLM_RELAY_*` environment variable, in one place.

The only module that reads the environment. Relay is configured through `RelayConfig`
(`--additional-config '{"relay": {...}}'`); these variables are what a configuration key cannot
carry: a file of prompts, where the demo's and tests' built models go, and which CUDA graphs the
GPU tests capture. Values are read on each access (a test's `monkeypatch.setenv` takes effect, and
spawned workers see the environment they were started with); an unset or empty variable reads as its
default. `check()` validates every one that is set; the front end calls it before any engine starts.
"""

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    VLLM_RELAY_SYSTEM_PROMPTS_FILE: str | None = None
    VLLM_RELAY_CACHE: str | None = None
    VLLM_RELAY_UNSPLIT_GRAPHS: int = 1
    VLLM_RELAY_VERIFY_GRAPHS: int = 0


def _str(name: str) -> str | None:
    return os.environ.get(name) or None


def _choice(name: str, default: int, choices: dict[int, str]) -> int:
    raw = _str(name)
    if raw is None:
        return default
    if raw.strip() not in {str(c) for c in choices}:
        expected = ", ".join(f"{c} ({what})" for c, what in choices.items())
        raise ValueError(f"{name}={raw!r}: expected one of {expected}")
    return int(raw)


def _folder(name: str) -> str | None:
    path = _str(name)
    if path is not None and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{name}={path!r}: not a folder")
    return path


UNSPLIT_GRAPHS = {0: "the split graph with levels only", 1: "split and unsplit, each where it runs faster",
                  2: "the unsplit graph on every step with levels"}

VERIFY_GRAPHS = {0: "vLLM's graphs for decodes verifying drafts", 1: "their graphs with levels"}

environment_variables: dict[str, Callable[[], Any]] = {
    # Path of a JSON file {name: text | [token ids] | {"chat_system": text}} merged into
    # RelayConfig.system_prompts (its entries win on a name clash): long prompts do not fit
    # comfortably in a command-line flag. Checked (readable, JSON, an object) by RelayConfig.from_vllm.
    "VLLM_RELAY_SYSTEM_PROMPTS_FILE": lambda: _str("VLLM_RELAY_SYSTEM_PROMPTS_FILE"),
    # Folder for the models and tokenizers `vllm_relay.testing` builds (the demo's, the tests', the
    # benchmarks'); unset: see vllm_relay.testing.models.cache_root.
    "VLLM_RELAY_CACHE": lambda: _folder("VLLM_RELAY_CACHE"),
    # Which full CUDA graphs with levels each decode size has (hooks/graphs.py): 1 (the default) the
    # split and the unsplit twin, each replayed on the steps it runs faster (the planner's rule); 2
    # the unsplit one on every step with levels (its GPU test); 0 the split one alone. The same
    # attention either way; 1 measured +0.9% at P=8192 against 0, for 0.12 GiB more graph memory
    # (Llama-2-7B shape, H200, 2026-11-28: benchmarks/results/2026-11-28_1337_h200/).
    "VLLM_RELAY_UNSPLIT_GRAPHS": lambda: _choice("VLLM_RELAY_UNSPLIT_GRAPHS", 1, UNSPLIT_GRAPHS),
    # Which full CUDA graphs decodes verifying drafts (1 + k tokens a request) replay (hooks/graphs.py):
    # 0 (the default) vLLM's, reading a shared prefix in each request's context (exact, no saving); 1
    # their levels' twins, and the drafter's first pass's (its GPU tests). The same attention either
    # way; 1 measured slower at 64 requests (n-gram drafts of 3, Llama-3-8B shape, P=2048: 3.23 ms a
    # token against vLLM's 2.81; 1 and 8 requests alike; H100, 2026-12-07:
    # benchmarks/results/2026-12-07_h100_vllm033_verification_graphs/).
    "VLLM_RELAY_VERIFY_GRAPHS": lambda: _choice("VLLM_RELAY_VERIFY_GRAPHS", 0, VERIFY_GRAPHS),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)


def is_set(name: str) -> bool:
    """Whether `name` (one of ours) is set to a non-empty value."""
    if name not in environment_variables:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _str(name) is not None


# Variables earlier releases read: set, they are refused rather than silently ignored.
KNOB = "a tuning knob, now the measured choice in the code: unset it"
KNOBS = ("LEVEL_KERNEL", "LEVEL_SPLITS", "GRAPH_LEVELS", "GRAPH_ONE_SPLIT", "GRAPH_SPLIT_CAP", "CHUNK_LEVELS",
         "JOINT", "JOINT_ROWS", "LEVEL_STREAM", "LEVEL_STREAM_PRIORITY", "DETOKENIZER_PRIME", "CACHE_HITS")
SECTION = "in the relay section of --additional-config"
REMOVED = {"VLLM_RELAY_MAX_PROMPTS": f"set max_prompts {SECTION}",
           "VLLM_RELAY_MAX_PROMPT_TOKENS": f"set max_prompt_tokens {SECTION}",
           "VLLM_RELAY_MLA": "relay's MLA backend serves MLA models on CUDA without it: unset it",
           **{f"VLLM_RELAY_{knob}": KNOB for knob in KNOBS}}


def check() -> None:
    """Read every variable that is set: a bad value, or a variable relay no longer reads, raises
    ValueError naming it and what to do."""
    for name, hint in REMOVED.items():
        if _str(name) is not None:
            raise ValueError(f"{name} is no longer read by vllm-relay: {hint}")
    for read in environment_variables.values():
        read()
