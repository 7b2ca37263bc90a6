"""Every `VLLM_RELAY_*` environment variable, in one place.

The only module that reads the environment (aesthetics principle 6). Values are read lazily, on
each attribute access, so a test's `monkeypatch.setenv` takes effect without a reload, and vLLM's
spawned workers see the environment they were started with. An unset or empty variable reads as
its default; `None` means "not set: the `RelayConfig` value stands".
"""

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    VLLM_RELAY_MAX_PROMPTS: int | None = None
    VLLM_RELAY_MAX_PROMPT_TOKENS: int | None = None
    VLLM_RELAY_SYSTEM_PROMPTS_FILE: str | None = None
    VLLM_RELAY_CACHE: str | None = None
    VLLM_RELAY_LEVEL_SPLITS: int | None = None
    VLLM_RELAY_LEVEL_KERNEL: str | None = None
    VLLM_RELAY_GRAPH_LEVELS: int | None = None
    VLLM_RELAY_GRAPH_ONE_SPLIT: int | None = None
    VLLM_RELAY_GRAPH_SPLIT_CAP: int | None = None
    VLLM_RELAY_CHUNK_LEVELS: int | None = None
    VLLM_RELAY_JOINT: int | None = None
    VLLM_RELAY_JOINT_ROWS: int | None = None
    VLLM_RELAY_UNSPLIT_GRAPHS: int | None = None
    VLLM_RELAY_LEVEL_STREAM: int | None = None
    VLLM_RELAY_LEVEL_STREAM_PRIORITY: int | None = None
    VLLM_RELAY_DETOKENIZER_PRIME: int | None = None
    VLLM_RELAY_CACHE_HITS: int | None = None
    VLLM_RELAY_TEST_SERVER: str | None = None
    VLLM_RELAY_TEST_API_KEY: str | None = None


def _str(name: str) -> str | None:
    return os.environ.get(name) or None


def _int(name: str) -> int | None:
    raw = _str(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: not an integer") from None


environment_variables: dict[str, Callable[[], Any]] = {
    # Overrides RelayConfig.max_prompts: how many system prompts can be registered at once
    # (the slots). Lets an operator change it without editing --additional-config.
    "VLLM_RELAY_MAX_PROMPTS": lambda: _int("VLLM_RELAY_MAX_PROMPTS"),
    # Overrides RelayConfig.max_prompt_tokens: the most tokens of one system prompt;
    # RelayConfig validates it after the override.
    "VLLM_RELAY_MAX_PROMPT_TOKENS": lambda: _int("VLLM_RELAY_MAX_PROMPT_TOKENS"),
    # Path of a JSON file {name: text | [token ids] | {"chat_system": text}} merged into RelayConfig.system_prompts
    # (its entries win on a name clash). Long prompts do not fit comfortably in a CLI flag.
    "VLLM_RELAY_SYSTEM_PROMPTS_FILE": lambda: _str("VLLM_RELAY_SYSTEM_PROMPTS_FILE"),
    # Tuning knob for benchmarks: the system level's FlashAttention-3 call with exactly this many
    # KV splits and no ahead-of-time schedule (0 or unset: FA3's own dynamic split, bounded by
    # the CUDA-graph cap, ops.graph_split_cap). Results are the same either way; only the speed changes.
    "VLLM_RELAY_LEVEL_SPLITS": lambda: _int("VLLM_RELAY_LEVEL_SPLITS"),
    # Tuning knob for benchmarks: the levels a full CUDA graph holds besides the system prompts'
    # (unset: attention.rules.GRAPH_LEVELS; 0: as many as its tokens can form). Deeper levels past
    # it are read in each request's context; results are the same, only the speed changes.
    "VLLM_RELAY_GRAPH_LEVELS": lambda: _int("VLLM_RELAY_GRAPH_LEVELS"),
    # Tuning knob for benchmarks: 0 leaves a graph's levels to FlashAttention-3's own split choice
    # every step (unset or 1: one split when their rows fill the GPU, attention.rules.graph_one_split).
    "VLLM_RELAY_GRAPH_ONE_SPLIT": lambda: _int("VLLM_RELAY_GRAPH_ONE_SPLIT"),
    # Tuning knob for benchmarks: 0 keeps vLLM's cap of FlashAttention-3's splits in CUDA graphs (32)
    # for the relay backend's calls; unset or 1: the cap FA3's schedule can use (ops.graph_split_cap).
    # Same splits and results; the graphs' split workspace, and so the KV cache, differ.
    "VLLM_RELAY_GRAPH_SPLIT_CAP": lambda: _int("VLLM_RELAY_GRAPH_SPLIT_CAP"),
    # Tuning knob for benchmarks: 1 lets a prompt chunk that fills its own query tiles read levels too
    # (the rule before; unset or 0: it reads its prompt in its context, attention.rules.fills_tiles).
    # Same results; only the speed changes.
    "VLLM_RELAY_CHUNK_LEVELS": lambda: _int("VLLM_RELAY_CHUNK_LEVELS"),
    # Tuning knob for benchmarks: 0 runs a decode step's levels as their own call beside the context
    # call (the form before); unset or 1: one FlashAttention call for both (attention.rules,
    # ops/joint.py). Same results; only the speed changes.
    "VLLM_RELAY_JOINT": lambda: _int("VLLM_RELAY_JOINT"),
    # Tuning knob for benchmarks: the query rows (tokens x query heads per KV head) of each level
    # sequence of a joint call in every step (unset: attention.rules.joint_tokens). Same results.
    "VLLM_RELAY_JOINT_ROWS": lambda: _int("VLLM_RELAY_JOINT_ROWS"),
    # Tuning knob for benchmarks: unset or 1 captures each full decode graph with levels twice, its
    # joint call split and unsplit (FlashAttention-3's one-pass kernel: no split workspace, no combine
    # launch), and replays the unsplit one on the steps the planner runs unsplit anyway
    # (rules.joint_one_split); 2 replays it on every step with levels (its tests); 0: the split graph
    # alone, its combine launched over the whole call every step (hooks/graphs.py). Same results; only
    # the speed and the graphs captured change (H200, 2026-11-28, benchmarks/results/2026-11-28_1337_h200/:
    # +0.9% at P=8192, 0.12 GiB more graph memory on a Llama-2-7B shape).
    "VLLM_RELAY_UNSPLIT_GRAPHS": lambda: _int("VLLM_RELAY_UNSPLIT_GRAPHS"),
    # Tuning knob for benchmarks: 0 runs the levels in vLLM's stream after the context call; 1 on a
    # second stream, concurrently, in every step; unset or 2 on it in full-CUDA-graph steps only,
    # eager steps in vLLM's stream (attention.backend.level_stream_mode). Same results.
    "VLLM_RELAY_LEVEL_STREAM": lambda: _int("VLLM_RELAY_LEVEL_STREAM"),
    # Tuning knob for benchmarks: that stream's CUDA priority (lower is higher; unset:
    # attention.backend.LEVEL_STREAM_PRIORITY).
    "VLLM_RELAY_LEVEL_STREAM_PRIORITY": lambda: _int("VLLM_RELAY_LEVEL_STREAM_PRIORITY"),
    # Which kernel runs the system level: "flash" (a gather, FlashAttention-3, the relay fusion;
    # the default) or "triton" (one fused launch: gather, split-K attention over the slot's pages,
    # LSE merge). Measured in benchmarks/results/archive/2026-11-21_h200/layer_h200.md; the results are
    # the same.
    "VLLM_RELAY_LEVEL_KERNEL": lambda: _str("VLLM_RELAY_LEVEL_KERNEL"),
    # Folder for the test fixtures' built models (vllm_relay.testing); unset: see
    # vllm_relay.testing.models.cache_root.
    "VLLM_RELAY_CACHE": lambda: _str("VLLM_RELAY_CACHE"),
    # Prompt tokens a relay front end's incremental detokenizer is primed with (hooks/detokenizer.py;
    # unset: 128; 0: the whole prompt, as vLLM does).
    "VLLM_RELAY_DETOKENIZER_PRIME": lambda: _int("VLLM_RELAY_DETOKENIZER_PRIME"),
    # Tuning knob for benchmarks: 0 leaves every new request's prefix-cache lookup to vLLM's walk over
    # its blocks (engine/cache_hits.py; unset: a lookup starts from a recent one's blocks). Same blocks.
    "VLLM_RELAY_CACHE_HITS": lambda: _int("VLLM_RELAY_CACHE_HITS"),
    # Base URL of an already running relay server (e.g. http://127.0.0.1:8000) for the endpoint
    # tests (tests/entrypoints/test_server.py) to run against instead of starting their own; the
    # server must run with the configuration of tests/entrypoints/server.py (benchmarks/gpu/endpoints.sh).
    "VLLM_RELAY_TEST_SERVER": lambda: _str("VLLM_RELAY_TEST_SERVER"),
    # The --api-key of that server.
    "VLLM_RELAY_TEST_API_KEY": lambda: _str("VLLM_RELAY_TEST_API_KEY"),
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
