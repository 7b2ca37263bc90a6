"""Run tests/e2e/run_offline.py in a subprocess and compare engines' outputs.

An engine that does not select relay is a reference: it runs with the plugin not loaded
(`VLLM_PLUGINS=""`), so it is vLLM as a user without relay has it.
"""

import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

RUNNER = Path(__file__).with_name("run_offline.py")


NO_TORCHVISION = Path(__file__).parent / "no_torchvision"  # sitecustomize: vLLM's Qwen-VL, no torchvision


def plugin_env(spec: dict) -> dict:
    """The environment of the engine `spec` describes: without the plugin unless it selects relay
    (or the spec says `"plugin": true`: the plugin loaded, vLLM's own backend selected); with
    `"vl": true`, the shim that lets vLLM import its Qwen-VL models without torchvision."""
    loaded = spec["engine"].get("attention_backend") == "relay" or spec.get("plugin", False)
    env = dict(os.environ) if loaded else {**os.environ, "VLLM_PLUGINS": ""}  # "": no plugin loads
    if spec.get("vl"):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(NO_TORCHVISION), env.get("PYTHONPATH")]))
    return env


def sized(spec: dict) -> dict:
    """`spec`, its engine sized for a shared GPU when RELAY_TEST_GPU_SHARE is set (a fraction: GPU test
    steps run side by side, `benchmarks/gpu/acceptance.sh --side-by-side`): that share of the GPU and
    a KV cache of fixed size, so vLLM skips its memory profiling, which expects the GPU to itself."""
    share = os.environ.get("RELAY_TEST_GPU_SHARE")
    if not share:
        return spec
    return {**spec, "engine": {"gpu_memory_utilization": float(share), "kv_cache_memory_bytes": 1 << 30,
                               **spec["engine"]}}


def run_engine(spec: dict, tmp_path: Path, name: str):
    spec = sized(spec)
    spec_file, out_file = tmp_path / f"{name}.spec.json", tmp_path / f"{name}.out.json"
    spec_file.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(RUNNER), str(spec_file), str(out_file)],
                          capture_output=True, text=True, timeout=1200, env=plugin_env(spec))
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out_file.read_text()), proc.stderr + proc.stdout


def run_module(module: str, spec: dict, tmp_path: Path, name: str) -> dict:
    """`python -m module SPEC_JSON OUT_JSON` from the repository root; its JSON output."""
    spec = sized(spec)
    spec_file, out_file = tmp_path / f"{name}.spec.json", tmp_path / f"{name}.out.json"
    spec_file.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", module, str(spec_file), str(out_file)],
                          capture_output=True, text=True, timeout=1200, cwd=Path(__file__).parents[2],
                          env=plugin_env(spec))
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out_file.read_text())


# vLLM's JIT monitor, active from the end of the engine's warm-up: each Triton compile after it is a
# latency spike in a served step (with `jit_monitor_verbose`, logged with its constants and signature).
JIT_LINE = re.compile(r"Triton kernel JIT compilation during inference: (\w+)")


def relay_kernels() -> set[str]:
    """The names of relay's Triton kernels: every `@triton.jit` function of `vllm_relay.ops` named `*_kernel`
    (compiled or, where TRITON_INTERPRET=1 was set before its module was imported, interpreted)."""
    from triton.runtime.jit import KernelInterface

    import vllm_relay.ops as ops

    return {name for m in pkgutil.iter_modules(ops.__path__)
            for name, obj in vars(importlib.import_module(f"vllm_relay.ops.{m.name}")).items()
            if isinstance(obj, KernelInterface) and name.endswith("_kernel")}


def relay_compiles_after_warm_up(log: str) -> list[str]:
    """The lines of an engine's log where vLLM's JIT monitor saw one of relay's kernels compiled after the
    engine's warm-up: a variant that neither the warm-up nor the CUDA graphs' capture compiled."""
    kernels = relay_kernels()
    return [line for line in log.splitlines() if (m := JIT_LINE.search(line)) and m.group(1) in kernels]


def assert_same_outputs(got: list, want: list, tol: float = 1e-4) -> float:
    """Identical greedy tokens, same top-5 sets, logprobs within `tol`; returns the worst diff."""
    worst = 0.0
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["tokens"] == w["tokens"], f"request {i}: {g['tokens']} != {w['tokens']}"
        for gs, ws in zip(g["logprobs"], w["logprobs"], strict=True):
            assert gs.keys() == ws.keys(), f"request {i}: top-5 sets differ"
            worst = max(worst, max(abs(gs[k] - ws[k]) for k in gs))
    assert worst < tol, worst
    return worst
