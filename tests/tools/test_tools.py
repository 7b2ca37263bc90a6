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
])
def test_tool_runs_and_writes_json(script, args, tmp_path):
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, str(REPO / "tools" / script), *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data, data
    assert "256" in json.dumps(data), data  # the prompt length asked for is in the results
