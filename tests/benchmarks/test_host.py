"""benchmarks/bench_host.py on the CPU: each scenario's batch has the levels it is built to have, the
phases are timed and written (the times themselves mean nothing here: the GPU host's count)."""

import json

from tests.benchmarks import load
from vllm_relay.attention import planner


def test_each_scenario_finds_its_levels(tmp_path):
    rule = dict(planner.MIN_SAVED_TOKENS)
    argv = ["--device", "cpu", "--reqs", "64", "--prompt", "2048", "--steps", "3", "--chunks", "8",
            "--out", str(tmp_path)]
    rows = load("bench_host").main(argv)
    assert planner.MIN_SAVED_TOKENS == rule  # the GPU's rule only while it ran
    found = {r["scenario"]: (r["levels"], r["level_rows"]) for r in rows}
    # 64 rows: a prompt over all (registered), 4 groups of 16 samples, or both levels (tree); mixed: the 64
    # decodes under the prompt, its 8 chunks of 128 tokens read it in their context (they fill FA3's tiles).
    assert found == {"plain": (0, 0), "registered": (1, 64), "samples": (4, 64), "tree": (5, 128), "mixed": (1, 64)}
    assert [r["chunks"] for r in rows] == [0, 0, 0, 0, 8]
    assert all(r["prepare_us"] > 0 and r["levels_us"] > 0 and r["plan_us"] > 0 for r in rows)
    saved = json.loads((tmp_path / "host.json").read_text())
    assert saved["rows"] == rows and "| tree | 64 | 2048 |" in (tmp_path / "host.md").read_text()
    assert "| mixed (+8 chunks) | 64 | 2048 |" in (tmp_path / "host.md").read_text()


def test_profile_names_the_planners_calls(tmp_path):
    argv = ["--device", "cpu", "--reqs", "8", "--scenarios", "mixed", "--chunks", "1", "--steps", "2", "--profile",
            "--out", str(tmp_path)]
    load("bench_host").main(argv)
    text = (tmp_path / "host_profile_mixed_8_1.txt").read_text()
    assert "planner.py" in text and "(plan)" in text and "(prepare)" in text
