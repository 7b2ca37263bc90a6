"""register(): re-entrant, cheap, and in effect in every process, spawned ones included."""

import multiprocessing as mp
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_relay
from vllm_relay import hooks

REPO = Path(__file__).resolve().parents[2]


def test_register_is_reentrant_and_aliases_custom():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    vllm_relay.register()
    vllm_relay.register()
    assert E["RELAY"] is E.CUSTOM
    assert E.CUSTOM.get_path() == vllm_relay.RELAY_BACKEND
    patched = hooks.applied_patches()
    assert "CpuPlatform.get_attn_backend_cls" in patched and len(patched) == len(set(patched)), patched


def test_backend_names_parse_in_any_case():
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    vllm_relay.register()
    for name in ("relay", "RELAY", "Relay"):
        assert AttentionConfig.validate_backend_before(name) is E.CUSTOM


def test_register_touches_no_device_and_imports_no_backend():
    # In a fresh interpreter: register() must not import torch.cuda state or the backends.
    code = (
        "import sys, vllm_relay; vllm_relay.register();"
        "import torch; assert not torch.cuda.is_initialized();"
        "assert 'vllm_relay.attention.backend' not in sys.modules;"
        "assert 'vllm_relay.attention.cpu_backend' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def _child_after_plugins(queue):
    # What vLLM's spawned engine core / workers do: load general plugins (entry points).
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    load_general_plugins()
    queue.put((E["RELAY"].name, E.CUSTOM.get_path()))


def _child_unpickle(payload, queue):
    # A spawned child unpickles the config before any plugin loads: the member must resolve.
    member = pickle.loads(payload)
    queue.put(member.name)


def test_alias_survives_spawn_and_pickling():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    vllm_relay.register()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    for target, args in ((_child_after_plugins, ()), (_child_unpickle, (pickle.dumps(E["RELAY"]),))):
        proc = ctx.Process(target=target, args=(*args, queue))
        proc.start()
        proc.join(300)
        assert proc.exitcode == 0
        result = queue.get(timeout=300)
        if target is _child_after_plugins:
            assert result == ("CUSTOM", vllm_relay.RELAY_BACKEND)
        else:
            assert result == "CUSTOM"


def test_cpu_platform_selects_relay_only_when_asked():
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
    from vllm.v1.attention.selector import AttentionSelectorConfig

    import torch

    vllm_relay.register()
    cfg = AttentionSelectorConfig(head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=32)
    assert CpuPlatform.get_attn_backend_cls(E.CUSTOM, cfg) == vllm_relay.RELAY_CPU_BACKEND
    assert CpuPlatform.get_attn_backend_cls(None, cfg) == E.CPU_ATTN.get_path()
    assert CpuPlatform.get_attn_backend_cls(E.FLASH_ATTN, cfg) == E.CPU_ATTN.get_path()
    windowed = cfg._replace(has_sliding_window=True)  # window layers read no level: served
    assert CpuPlatform.get_attn_backend_cls(E.CUSTOM, windowed) == vllm_relay.RELAY_CPU_BACKEND
    bad = cfg._replace(use_non_causal=True)
    with pytest.raises(ValueError, match="relay attention backend does not support.*non-causal"):
        CpuPlatform.get_attn_backend_cls(E.CUSTOM, bad)


def test_patches_revert_and_ledger_lists_them():
    from vllm.platforms.cpu import CpuPlatform

    from vllm_relay.hooks import model_runner, runner

    vllm_relay.register()
    runner.apply_worker()  # the worker-only patches: the V1 runner's (the CPU's), applied by the builders,
    model_runner.apply_worker()  # and Model Runner V2's, applied by the first relay attention layer
    patched = CpuPlatform.get_attn_backend_cls
    names = hooks.applied_patches()
    assert {"GPUModelRunner._prepare_inputs", "GPUModelRunner.gather_batch_req_state",
            "vllm.v1.worker.gpu.model_states.resolve_model_state_cls"} <= set(names), names
    hooks.revert_all()
    try:
        assert CpuPlatform.get_attn_backend_cls != patched
        ledger = (REPO / "patches" / "README.md").read_text()
        for name in names:
            assert f"`{name}`" in ledger, f"{name} is patched but not in patches/README.md"
    finally:
        vllm_relay.register()


@pytest.mark.engine
def test_every_change_a_running_relay_engine_makes_is_in_the_ledger(tmp_path):
    """A relay engine (engine core and worker in one process) serves a registered prompt: every
    patched attribute and every attribute set on one of vLLM's objects is listed in
    patches/README.md (an instance change under its class or one of its bases)."""
    from tests.e2e.engine_runner import run_module
    from vllm_relay.testing.models import get_model

    spec = {"engine": {"attention_backend": "relay"}, "model": get_model("tiny-llama-mha")}
    got = run_module("tests.hooks.run_instance_ledger", spec, tmp_path, "ledger")
    ledger = (REPO / "patches" / "README.md").read_text()
    for name in got["patched"]:
        assert f"`{name}`" in ledger, f"{name} is patched but not in patches/README.md"
    names = {alternative for change in got["instances"] for alternative in change}
    for change in got["instances"]:
        assert any(f"`{n}`" in ledger for n in change), f"{change[0]} (instance) is not in patches/README.md"
    # The engine core's own changes were made (the check above saw them).
    assert {"EngineCore.vllm_relay", "EngineCore.relay_stats", "Request._vllm_relay"} <= names, names
