"""The host-timing tools run against the installed vLLM and write their JSON (small sizes; what they
time is not checked here: timings belong to the GPU host's runs)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script, args", [
    ("bench_prompt_hashes.py", ["--prompt-lens", "256", "--reps", "3"]),
    ("bench_cache_hits.py", ["--prompt-lens", "256", "--n", "8", "--rounds", "1"]),
    ("bench_detokenizer.py", ["--prompt-lens", "256", "--n", "4", "--reps", "2", "--model", "tiny-llama-gqa"]),
    ("bench_request_transport.py", ["--prompt-lens", "256", "--n", "4", "--reps", "2"]),
    ("bench_staged_tokens.py", ["--prompt-lens", "256", "--n", "4", "--reps", "2"]),
])
def test_tool_runs_and_writes_json(script, args, tmp_path):
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / script), *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data, data
    assert "256" in json.dumps(data), data  # the prompt length asked for is in the results


@pytest.mark.engine
@pytest.mark.parametrize("multiprocess,background,profile",
                         [(False, 0, True), (True, 0, True), (False, 2, True), (False, 0, False)])
def test_first_token_profile_covers_the_engine_core_in_process(tmp_path, multiprocess, background, profile):
    """One relay engine on a tiny model, a registered system prompt in front of each cold prompt: both
    first-token times and a profile. In process, the profile reaches the scheduler and the model runner and
    the steps are listed; with --multiprocess the engine core is another process, out of the profile; with
    --background, requests decode in every step of the timed ones; with --no-profile, the times only. The
    host's speed is recorded before and after the timed requests."""
    import os

    out = tmp_path / "out.json"
    args = ["--config", "relay", "--model", "tiny-llama-gqa", "--prefix-len", "256", "--system-len", "64",
            "--n", "8", "--repeat", "2", "--max-model-len", "512", "--block-size", "32", "--top", "200",
            "--background", str(background), "--out", str(out)]
    args += (["--multiprocess"] if multiprocess else []) + ([] if profile else ["--no-profile"])
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "profile_first_token.py"), *args],
                          capture_output=True, text=True, timeout=900, cwd=REPO,
                          env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert set(data["first_token_s"]) == {"1", "8"} and all(t > 0 for t in data["first_token_s"].values())
    speed = data["host_speed_us"]
    assert len(speed) == 2 and all(t > 0 for t in speed), speed
    if not profile:
        assert data["cumulative"] is None and data["profiled_s"] is None
        assert not (tmp_path / "out.json.pstats").exists()
        assert sum(s["admitted"] for s in data["steps"]) == 8, data["steps"]
        return
    assert (tmp_path / "out.json.pstats").stat().st_size > 0
    names = [r["function"] for r in data["cumulative"]]
    assert data["multiprocess"] is multiprocess and data["background"] == background, data
    assert any("(generate)" in f or "(step)" in f for f in names), names
    in_process = any("(schedule)" in f for f in names) and any("(execute_model)" in f for f in names)
    assert in_process is not multiprocess, names
    steps = data["steps"]  # the scheduler's steps of the last timed n case: every child admitted once
    if multiprocess:
        assert steps == []
        return
    assert sum(s["admitted"] for s in steps) == 8 and sum(s["tokens"] for s in steps) >= 256, steps
    # relay's requests carry only their own tokens: the registered prompt is neither computed nor "cached"
    # (and each background request decodes one token a step)
    assert sum(s["tokens"] + s["cached"] for s in steps) == 8 * 256 + background * len(steps), steps
    assert all(s["requests"] > background for s in steps), steps
