"""benchmarks/account.py: the accounting rows of two profiled runs add up to their gap, by kind of
step and kernel family, against hand-computed step tables."""

import json

import pytest

from tests.benchmarks import load

account = load("account")


def step(ctx_tokens, cycle, fams, busy=None, gen_tokens=4):
    busy = sum(fams.values()) if busy is None else busy
    return {"ctx_reqs": int(ctx_tokens > 0), "ctx_tokens": ctx_tokens, "gen_reqs": 4, "gen_tokens": gen_tokens,
            "cycle_us": cycle, "busy_us": busy, "idle_us": cycle - busy, "families_us": fams}


A = [step(512, 9000, {"gemm": 5000, "attention": 2000, "relay": 500}),
     step(0, 3000, {"gemm": 1500, "attention": 700, "relay": 100, "triton_x": 200}),
     step(0, 3200, {"gemm": 1500, "attention": 800, "relay": 100}, busy=2300)]  # 100 us of overlap
B = [step(512, 8000, {"gemm": 5000, "attention": 1500}),
     step(0, 2500, {"gemm": 1500, "attention": 600})]


def test_rows_add_up_to_the_gap_by_kind_and_family():
    table = account.account(A, 0.020, B, 0.012)
    rows = {r["row"]: r for r in table}
    assert (rows["prefill steps"]["a"], rows["decode steps"]["a"], rows["decode steps"]["b"]) == (1, 2, 1)
    assert rows["decode: attention"]["diff"] == pytest.approx((700 + 800 - 600) / 1e6)
    assert rows["decode: relay"]["a"] == pytest.approx(200 / 1e6)
    assert rows["decode: other"]["a"] == pytest.approx(200 / 1e6)  # an unknown family counts as other
    assert rows["decode: kernel overlap"]["a"] == pytest.approx(-100 / 1e6)
    assert rows["decode: GPU idle"]["a"] == pytest.approx((3000 - 2500 + 3200 - 2300) / 1e6)
    assert rows["prefill: GPU idle"]["diff"] == pytest.approx((1500 - 1500) / 1e6)
    assert rows["outside steps"]["a"] == pytest.approx(0.020 - 0.0152)
    assert rows["run time"]["diff"] == pytest.approx(0.008)
    parts = sum(r["diff"] for r in table[:-1] if r["diff"] is not None)
    assert parts == pytest.approx(0.008, abs=1e-12)


def test_a_resumed_request_computed_again_makes_a_prefill_step():
    """vLLM's V1 runner annotates a preempted request's recomputed tokens as generation tokens,
    Model Runner V2 as context: either way the step is a prompt step, not a decode step."""
    recompute = step(0, 7000, {"gemm": 4000, "attention": 1500}, gen_tokens=4 + 300)
    rows = {r["row"]: r for r in account.account(A + [recompute], 0.027, B, 0.012)}
    assert (rows["prefill steps"]["a"], rows["decode steps"]["a"]) == (2, 2)
    assert rows["prefill: gemm"]["a"] == pytest.approx((5000 + 4000) / 1e6)
    assert rows["decode: gemm"]["a"] == pytest.approx((1500 + 1500) / 1e6)


def test_recompute_splits_prefill_steps_into_prompts_and_recomputed_requests():
    """--recompute: a step with prompt chunks is a prompt step (even beside resumed tokens), a step
    whose only multi-token requests are generation tokens (the V1 runner's resumed requests) a
    recompute step; the rows still add up to the gap, and to the two-kind table's prefill rows."""
    recompute = step(0, 7000, {"gemm": 4000, "attention": 1500}, gen_tokens=4 + 300)
    both = step(256, 6000, {"gemm": 3000, "attention": 900}, gen_tokens=4 + 100)
    a = A + [recompute, both]
    table = account.account(a, 0.033, B, 0.012, split=True)
    rows = {r["row"]: r for r in table}
    assert (rows["prompt steps"]["a"], rows["recompute steps"]["a"], rows["decode steps"]["a"]) == (2, 1, 2)
    assert (rows["prompt steps"]["b"], rows["recompute steps"]["b"]) == (1, 0)
    assert rows["recompute: attention"]["a"] == pytest.approx(1500 / 1e6)
    assert rows["prompt: gemm"]["a"] == pytest.approx((5000 + 3000) / 1e6)
    assert rows["prompt: GPU idle"]["a"] == pytest.approx((9000 - 7500 + 6000 - 3900) / 1e6)
    assert sum(r["diff"] for r in table[:-1] if r["diff"] is not None) == pytest.approx(0.021, abs=1e-12)
    two = {r["row"]: r for r in account.account(a, 0.033, B, 0.012)}
    for part in ("attention", "gemm", "GPU idle"):
        assert rows[f"prompt: {part}"]["diff"] + rows[f"recompute: {part}"]["diff"] == \
            pytest.approx(two[f"prefill: {part}"]["diff"])


def test_load_reads_the_profiles_beside_the_result_and_the_unprofiled_run(tmp_path):
    result = {"relay": {"single": {"requests": 100, "elapsed_s": 2.0, "runs_requests_per_s": [50.0, 40.0]}}}
    (tmp_path / "r.json").write_text(json.dumps(result))
    (tmp_path / "r.relay.profile").mkdir()
    (tmp_path / "r.relay.profile" / "steps_0.json").write_text(json.dumps({"steps": A}))
    rows, elapsed, later = account.load(str(tmp_path / "r.json"), "relay", "single")
    assert rows == A and elapsed == 2.0 and later == pytest.approx(2.5)
    result["relay"]["single"]["runs_requests_per_s"] = [50.0, 40.0, 25.0, 20.0]  # later runs: 2.5, 4, 5 s
    (tmp_path / "r.json").write_text(json.dumps(result))
    assert account.load(str(tmp_path / "r.json"), "relay", "single")[2] == pytest.approx(4.0)  # their median
    (tmp_path / "r.relay.profile" / "steps_0.json").write_text(json.dumps({"error": "KeyError('ts')"}))
    with pytest.raises(SystemExit, match="holds no steps"):
        account.load(str(tmp_path / "r.json"), "relay", "single")
    with pytest.raises(SystemExit, match="has no run of noprefix"):
        account.load(str(tmp_path / "r.json"), "noprefix", "single")


def test_markdown_states_the_sum_and_the_unprofiled_gap():
    md = account.markdown(account.account(A, 0.020, B, 0.012), ("relay", "noprefix"), (1.10, 1.00))
    assert "| decode: attention | 0.002 s | 0.001 s | +1 ms |" in md
    assert "The rows add up to +8 ms; the profiled runs' gap is +8 ms." in md
    assert "gap +100 ms (1.100x the time); the rows add up to 8.0% of it." in md


def test_more_unprofiled_runs_join_the_medians(tmp_path, capsys, monkeypatch):
    """--unprofiled: another result's runs (none profiled) join the later runs of the profiled one."""
    def result(profile, relay_runs, noprefix_runs):
        return {"args": {"profile": profile},
                "relay": {"single": {"requests": 100, "elapsed_s": 2.0, "runs_requests_per_s": relay_runs}},
                "noprefix": {"single": {"requests": 100, "elapsed_s": 1.2,
                                        "runs_requests_per_s": noprefix_runs}}}

    profiled = result("0,0", [50.0, 40.0], [80.0, 50.0])
    more = result(None, [25.0, 20.0], [100.0, 40.0])
    (tmp_path / "r.json").write_text(json.dumps(profiled))
    (tmp_path / "m.json").write_text(json.dumps(more))
    for config, rows in (("relay", A), ("noprefix", B)):
        (tmp_path / f"r.{config}.profile").mkdir()
        (tmp_path / f"r.{config}.profile" / "steps_0.json").write_text(json.dumps({"steps": rows}))
    assert account.run_seconds(str(tmp_path / "m.json"), "relay", "single") == [4.0, 5.0]  # none profiled
    assert account.run_seconds(str(tmp_path / "r.json"), "relay", "single") == [2.5]  # the first was
    out = tmp_path / "acct.md"
    argv = ["account.py", str(tmp_path / "r.json"), "--unprofiled", str(tmp_path / "m.json"),
            "--out", str(out)]
    monkeypatch.setattr("sys.argv", argv)
    account.main()
    # relay: 2.5, 4, 5 s (median 4); noprefix: 2, 1, 2.5 s (median 2)
    md = out.read_text()
    assert "unprofiled runs: 3 and 3): relay 4.000 s, noprefix 2.000 s, gap +2000 ms" in md
    saved = json.loads((tmp_path / "acct.rows.json").read_text())
    assert saved["unprofiled_s"] == [4.0, 2.0]
    assert saved["unprofiled_runs_s"] == [[2.5, 4.0, 5.0], [2.0, 1.0, 2.5]]
