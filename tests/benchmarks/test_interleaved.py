"""benchmarks/bench_interleaved.py: the summary of interleaved rounds, its markdown, the arguments every
engine gets, and the driver's rounds against stand-in workers (no engine starts)."""

import json
import sys
from types import SimpleNamespace

import pytest

from tests.benchmarks import BENCH, load

bi = load("bench_interleaved")
common = load("common")


def run(rps: float) -> dict:
    return {"elapsed_s": 1000 / rps, "requests_per_s": rps, "output_tokens": 256_000}


def test_summary_gives_medians_spread_and_ratios_against_the_first_config():
    runs = {"default": [run(40.0), run(44.0), run(42.0)],
            "noprefix-relay": [run(36.0), run(46.2), run(44.1)],
            "relay": [run(80.0), run(88.0), run(84.0)]}
    s = bi.summary(runs)
    assert s["default"]["runs"] == [40.0, 44.0, 42.0]
    assert (s["default"]["median"], s["default"]["min"], s["default"]["max"]) == (42.0, 40.0, 44.0)
    assert s["default"]["spread"] == pytest.approx(4.0 / 42.0)
    assert not any(k.startswith(("median_over", "per_round_over")) for k in s["default"])
    assert s["noprefix-relay"]["median"] == 44.1
    assert s["noprefix-relay"]["median_over_default"] == pytest.approx(44.1 / 42.0)
    assert s["noprefix-relay"]["per_round_over_default"] == pytest.approx([0.9, 1.05, 1.05])
    # the ratio of medians, not the median of the per-round ratios
    assert s["relay"]["median_over_default"] == pytest.approx(2.0)
    assert s["relay"]["per_round_over_default"] == pytest.approx([2.0, 2.0, 2.0])


def test_summary_refuses_configurations_with_different_numbers_of_rounds():
    with pytest.raises(ValueError):
        bi.summary({"default": [run(40.0), run(44.0)], "noprefix-relay": [run(36.0)]})


def test_markdown_has_every_round_the_ratio_and_whether_the_requests_were_the_same():
    s = bi.summary({"default": [run(40.0), run(44.0), run(42.0)],
                    "noprefix-relay": [run(36.0), run(46.2), run(44.1)]})
    sent = {"requests": 1000, "prompt_tokens": 129_000, "output_tokens": 256_000, "digest": "ab"}
    same = {c: sent for c in s}
    md = bi.markdown(s, same, "single", 0.45)
    assert "3 interleaved rounds (default, noprefix-relay in turn" in md
    assert "gpu_memory_utilization 0.45 each), workload single" in md
    assert "| config | round 1 | round 2 | round 3 | median | spread | median / default |" in md
    assert "| default | 40.00 | 44.00 | 42.00 | 42.00 | 40.00-44.00 | |" in md
    assert "| noprefix-relay | 36.00 | 46.20 | 44.10 | 44.10 | 36.00-46.20 | **1.050** |" in md
    assert md.endswith("\nRequests: the same on every configuration\n"
                       "noprefix-relay / default: median 1.050, per round 0.900, 1.050, 1.050\n")
    differ = {**same, "noprefix-relay": {**same["default"], "prompt_tokens": 128_000, "digest": "cd"}}
    assert ("Requests: not the same: default 1000 requests, 129000 prompt tokens; noprefix-relay 1000 "
            "requests, 128000 prompt tokens") in bi.markdown(s, differ, "single", 0.45)


def test_describe_tells_the_same_requests_from_different_ones():
    prompts, out_lens = [[1, 7, 8, 9], [1, 5, 6]], [4, 4]
    d = bi.describe(prompts, out_lens)
    assert (d["requests"], d["prompt_tokens"], d["output_tokens"]) == (2, 7, 8)
    assert bi.describe([list(p) for p in prompts], list(out_lens))["digest"] == d["digest"]
    assert bi.describe(common.strip_system(prompts, [[1, 7]]), out_lens)["digest"] != d["digest"]
    assert bi.describe(prompts, [4, 5])["digest"] != d["digest"]


def test_both_throughput_drivers_take_the_requests_and_engine_arguments_from_common():
    bt = load("bench_throughput")
    for name in ("workload", "strip_system", "engine_kwargs", "sampling_params"):
        assert getattr(bi, name).__module__ == getattr(bt, name).__module__ == "common"


def parse(*extra):
    return bi.parse_args(["--model", "m", *extra])


def test_every_config_gets_the_engine_arguments_of_bench_throughput():
    args = parse("--configs", "default,noprefix-relay,relay", "--gpu-memory-utilization", "0.3")
    assert (args.rounds, args.workload, args.prefix_len, args.num_prompts) == (5, "single", 2048, 1000)
    relay_plain = common.engine_kwargs(args, "noprefix-relay", [[1]])
    assert relay_plain["attention_backend"] == "relay" and "additional_config" not in relay_plain
    assert relay_plain["gpu_memory_utilization"] == 0.3 and relay_plain["tensor_parallel_size"] == 1
    default = common.engine_kwargs(args, "default", [[1]])
    assert "attention_backend" not in default and "profiler_config" not in default
    relay = common.engine_kwargs(args, "relay", [[1, 7, 9]])
    assert relay["additional_config"]["relay"]["system_prompts"] == {"s0": [1, 7, 9]}


@pytest.mark.parametrize("extra", [
    ("--configs", "default"),  # nothing to compare with
    ("--configs", "default,default"),
    ("--configs", "default,bench"),  # not one of bench_throughput's engine configurations
    ("--rounds", "0"),
    ("--configs", "noprefix,noprefix-relay,default", "--gpu-memory-utilization", "0.4"),  # 1.2 GPUs
])
def test_arguments_that_cannot_run_are_refused(extra, capsys):
    with pytest.raises(SystemExit):
        parse(*extra)
    assert "error" in capsys.readouterr().err


# A stand-in worker: READY, then one RUN line per "run" line, its requests/s scripted per configuration;
# each run appends its configuration to ORDER, so the order of the runs can be checked.
FAKE = """
import json, sys
config, order = sys.argv[1], sys.argv[2]
rps = {"default": [40.0, 44.0, 42.0], "noprefix-relay": [36.0, 46.2, 44.1]}[config]
print("INFO a line of the engine's log", flush=True)
sent = {"requests": 2, "prompt_tokens": 6, "output_tokens": 8, "digest": "d"}
print("READY " + json.dumps(sent), flush=True)
for i, line in enumerate(sys.stdin):
    if line.strip() != "run":
        break
    with open(order, "a") as f:
        f.write(config + " ")
    run = {"elapsed_s": 1000 / rps[i], "requests_per_s": rps[i], "output_tokens": 8}
    print("RUN " + json.dumps(run), flush=True)
"""


def test_the_driver_runs_every_config_in_turn_on_warm_workers(tmp_path, monkeypatch, capsys):
    order, commands = tmp_path / "order.txt", []

    def worker_command(script, config):
        commands.append((script, config))
        return [sys.executable, "-c", FAKE, config, str(order)]

    out = tmp_path / "plain.json"
    monkeypatch.setattr(bi, "worker_command", worker_command)
    monkeypatch.setattr(sys, "argv", ["bench_interleaved.py", "--model", "m", "--configs",
                                      "default,noprefix-relay", "--rounds", "3", "--prefix-len", "0",
                                      "--out", str(out)])
    bi.main()
    assert commands == [(str(BENCH / "bench_interleaved.py"), "default"),
                        (str(BENCH / "bench_interleaved.py"), "noprefix-relay")]
    assert order.read_text().split() == ["default", "noprefix-relay"] * 3
    result = json.loads(out.read_text())
    assert result["args"]["prefix_len"] == 0 and "worker" not in result["args"]
    assert [r["requests_per_s"] for r in result["runs"]["noprefix-relay"]] == [36.0, 46.2, 44.1]
    assert result["requests"]["default"]["digest"] == "d"
    assert result["summary"]["noprefix-relay"]["median_over_default"] == pytest.approx(1.05)
    md = (tmp_path / "plain.md").read_text()
    assert "**1.050**" in md and md in capsys.readouterr().out
    assert "READY" in (tmp_path / "plain.default.log").read_text()


def test_a_worker_that_dies_before_it_is_ready_names_its_log(tmp_path, monkeypatch):
    script = "import sys; print('Traceback: no GPU', file=sys.stderr); sys.exit(3)"
    monkeypatch.setattr(bi, "worker_command", lambda _script, _config: [sys.executable, "-c", script])
    dead = r"relay: the worker exited \(rc 3\) before READY; see .*r\.relay\.log"
    with pytest.raises(RuntimeError, match=dead):
        bi.Engine(SimpleNamespace(out=str(tmp_path / "r.json")), "relay")
    assert "no GPU" in (tmp_path / "r.relay.log").read_text()


def test_samples_are_measured_in_output_tokens_per_second():
    assert bi.metric("samples") == "tokens_per_s"
    assert bi.metric("single") == bi.metric("multi") == "requests_per_s"
    runs = {"default": [{"tokens_per_s": x, "requests_per_s": 1.0} for x in (9000.0, 9400.0, 9200.0)],
            "relay": [{"tokens_per_s": x, "requests_per_s": 1.0} for x in (12880.0, 11280.0, 12420.0)]}
    s = bi.summary(runs, "tokens_per_s")
    assert s["relay"]["median_over_default"] == pytest.approx(12420.0 / 9200.0)
    assert s["relay"]["per_round_over_default"] == pytest.approx([1.4312, 1.2, 1.35], abs=1e-4)
    sent = {c: {"requests": 3, "prompt_tokens": 12288, "output_tokens": 24576, "digest": "ab"} for c in s}
    md = bi.markdown(s, sent, "samples", 0.45)
    assert md.startswith("Output tokens/s, 3 interleaved rounds (default, relay in turn")
    assert "| relay | 12880.00 | 11280.00 | 12420.00 | 12420.00 | 11280.00-12880.00 | **1.350** |" in md


def test_samples_prompts_are_one_a_round_the_same_for_every_engine(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 500, "image_token_id": 400}))
    args = parse("--workload", "samples", "--configs", "default,relay", "--prefix-len", "40")
    args.model = str(tmp_path)
    prompts = bi.random_prompts(args, 3, 40, 1000)
    assert prompts == bi.random_prompts(args, 3, 40, 1000)  # each engine draws the same
    assert [len(p) for p in prompts] == [40] * 3 and all(p[0] == 1 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 3  # a cold prompt each round
    assert all(100 <= t < 400 for p in prompts for t in p[1:])  # below the image placeholder
    assert bi.random_prompts(args, 1, 40, 1001)[0] == prompts[1]


@pytest.mark.parametrize("extra", [
    ("--configs", "default,noprefix-relay"),  # samples: relay finds the prompt itself; no "noprefix" side
    ("--configs", "default,relay", "--n", "0"),
    ("--configs", "default,relay", "--prefix-len", "1"),
])
def test_samples_arguments_that_cannot_run_are_refused(extra, capsys):
    with pytest.raises(SystemExit):
        parse("--workload", "samples", *extra)
    assert "--workload samples" in capsys.readouterr().err
    assert parse("--workload", "samples", "--configs", "relay,default", "--n", "256").n == 256


def test_the_driver_reports_samples_in_tokens_per_second(tmp_path, monkeypatch, capsys):
    fake = FAKE.replace('"requests_per_s": rps[i]', '"requests_per_s": 1.0, "tokens_per_s": 100 * rps[i]')
    fake = fake.replace('"noprefix-relay": [36.0, 46.2, 44.1]', '"relay": [36.0, 46.2, 44.1]')
    order = tmp_path / "order.txt"
    monkeypatch.setattr(bi, "worker_command",
                        lambda _script, config: [sys.executable, "-c", fake, config, str(order)])
    out = tmp_path / "samples.json"
    monkeypatch.setattr(sys, "argv", ["bench_interleaved.py", "--model", "m", "--workload", "samples",
                                      "--configs", "default,relay", "--rounds", "3", "--out", str(out)])
    bi.main()
    result = json.loads(out.read_text())
    assert result["summary"]["relay"]["runs"] == [3600.0, 4620.0, 4410.0]
    assert result["summary"]["relay"]["median_over_default"] == pytest.approx(1.05)
    assert "round 2 relay: 4620.00 tokens/s" in capsys.readouterr().out
