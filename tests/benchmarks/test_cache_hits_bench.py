"""benchmarks/bench_cache_hits.py on the CPU: every sample of the prompt is found cached up to its last
block with and without the memo (the benchmark asserts it), and the table is written (the times
themselves mean nothing here)."""

import json
import sys

from tests.benchmarks import load


def test_both_lookups_find_the_prompt_and_the_table_is_written(tmp_path, monkeypatch):
    out = tmp_path / "hits.json"
    monkeypatch.setattr(sys, "argv", ["bench_cache_hits.py", "--prompt-lens", "100,161", "--n", "5",
                                      "--rounds", "2", "--out", str(out)])
    load("bench_cache_hits").main()
    rows = json.loads(out.read_text())["rows"]
    assert [(r["prompt_len"], r["n"]) for r in rows] == [(100, 5), (161, 5)]
    assert all(r[f"{s}_{k}"] > 0 for r in rows for s in ("vllm", "relay") for k in ("lookup_us", "estimate_us"))
    assert "| 161 |" in (tmp_path / "hits.md").read_text()
