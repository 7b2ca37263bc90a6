"""benchmarks/bench_serving.py: each configuration's server command line (benchmarks/common.py), the rounds'
order and merge, and the server's phase means."""

import asyncio
import json
import re
import sys

import pytest

from tests.benchmarks import load

bench = load("bench_serving")
common = load("common")


def args(*extra):
    sys_argv, sys.argv = sys.argv, ["bench_serving.py", "--model", "/m", "--server-args", "--foo 1", *extra]
    try:
        return bench.parse_args()
    finally:
        sys.argv = sys_argv


def value(cmd, flag):
    return cmd[cmd.index(flag) + 1]


def test_relay_registers_the_system_prompts_and_relay_plain_registers_nothing():
    systems = [[1, 7, 9], [1, 5]]
    relay = common.server_command(args(), "relay", systems, 8000, gpu=False)
    assert value(relay, "--attention-backend") == "relay"
    cfg = json.loads(value(relay, "--additional-config"))["relay"]
    assert cfg == {"system_prompts": {"s0": [1, 7, 9], "s1": [1, 5]}, "max_prompts": 2, "max_prompt_tokens": 3}
    plain = common.server_command(args(), "relay-plain", systems, 8000, gpu=True)
    assert value(plain, "--attention-backend") == "relay" and "--additional-config" not in plain
    assert value(plain, "--load-format") == "dummy" and plain[plain.index("serve") + 1] == "/m"
    default = common.server_command(args(), "default", systems, 8000, gpu=False)
    assert "--attention-backend" not in default and value(default, "--port") == "8000"
    assert default[-2:] == ["--foo", "1"]
    for config in ("relay-full", "default-full"):  # the same servers, with full graphs for every batch
        full = common.server_command(args(), config, systems, 8000, gpu=True)
        assert json.loads(value(full, "--compilation-config")) == {"cudagraph_mode": "FULL"}
        assert ("--additional-config" in full) == (config == "relay-full")
        assert ("--attention-backend" in full) == (config == "relay-full")
    assert "--compilation-config" not in relay and "--compilation-config" not in default


def test_relay_servers_load_relays_endpoint_plugin(monkeypatch):
    """Relay's servers run as docs/serving.md configures them, with `VLLM_PLUGINS=relay` (its routes and
    /metrics series); the others in the caller's environment, and a caller's own VLLM_PLUGINS is kept."""
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert common.server_env("relay")["VLLM_PLUGINS"] == "relay"
    assert common.server_env("relay-plain")["VLLM_PLUGINS"] == "relay"
    assert common.server_env("default") is None and common.server_env("sglang") is None
    monkeypatch.setenv("VLLM_PLUGINS", "relay,other")
    assert common.server_env("relay") is None


def test_sglang_serves_the_same_model_in_its_environment_without_vllms_arguments(tmp_path):
    """SGLang's server: its own launcher in the environment of --sglang-env, the model with dummy weights,
    the same context length, seed and served name, its own extra arguments (not --server-args, vLLM's),
    and the GPU share as SGLang's --mem-fraction-static."""
    import subprocess

    env = tmp_path / "env.sh"
    env.write_text("export SGLANG_SEEN=yes\n")
    a = args("--sglang-env", str(env), "--sglang-server-args", "--attention-backend fa3", "--seed", "5")
    cmd = common.server_command(a, "sglang", [[1, 2]], 8100, gpu=True, share="0.44")
    launcher = cmd[cmd.index("sglang.launch_server") - 2:]
    assert launcher[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert value(cmd, "--model-path") == "/m"
    assert value(cmd, "--load-format") == "dummy" and value(cmd, "--port") == "8100"
    assert value(cmd, "--context-length") == "4096" and value(cmd, "--random-seed") == "5"
    assert value(cmd, "--served-model-name") == "m" and value(cmd, "--attention-backend") == "fa3"
    assert value(cmd, "--mem-fraction-static") == "0.44" and "--foo" not in cmd
    # The wrapper sources the environment, then runs the launcher's arguments as given.
    probe = cmd[:4] + ["bash", "-c", 'echo "$SGLANG_SEEN" "$@"', "x", "--port", "8100"]
    assert subprocess.run(probe, capture_output=True, text=True).stdout.split() == ["yes", "--port", "8100"]


def test_an_unknown_config_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown config 'relay_plain'"):
        common.server_command(args(), "relay_plain", [[1]], 0, gpu=False)


def test_server_phase_means_from_a_metrics_page():
    """vLLM's request-phase histograms, written by prometheus_client as vLLM's server writes them (two
    engines' label sets), read back as per-phase means over the requests between two pages."""
    import random

    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    reg = CollectorRegistry()
    hists = {phase: Histogram(name, "x", ["engine"], registry=reg)
             for phase, name in bench.PHASES.items()}
    rng = random.Random(5)

    def page():
        return generate_latest(reg).decode()

    for h in hists.values():
        h.labels(engine="0").observe(1.0)
    before = bench.histogram_totals(page())
    seen = {phase: [] for phase in hists}
    for phase, h in hists.items():
        if phase == "decode":
            continue  # no request finished decoding: no mean
        for _ in range(rng.randint(1, 9)):
            x = rng.random()
            seen[phase].append(x)
            h.labels(engine=str(rng.randint(0, 1))).observe(x)
    means = bench.phase_means_ms(before, bench.histogram_totals(page()))
    for phase, xs in seen.items():
        if xs:
            assert means[phase] == pytest.approx(sum(xs) / len(xs) * 1e3)
        else:
            assert means[phase] is None


def test_servers_sharing_the_gpu_get_equal_memory_shares_unless_the_user_set_one():
    assert common.gpu_share(args(), 1) is None
    assert common.gpu_share(args(), 2) == "0.44" and common.gpu_share(args(), 3) == "0.29"
    mine = args("--server-args", "--gpu-memory-utilization 0.3")
    assert common.gpu_share(mine, 2) is None
    cmd = common.server_command(args(), "relay", [[1, 2]], 8000, gpu=True, share="0.44")
    assert value(cmd, "--gpu-memory-utilization") == "0.44"
    assert "--gpu-memory-utilization" not in common.server_command(args(), "relay", [[1, 2]], 8000, gpu=True)


def test_rounds_merge_into_per_rate_medians_and_keep_each_round():
    import random

    rng = random.Random(11)

    def row(rate):
        f = lambda: {"p50": rng.random(), "p99": rng.random()}  # noqa: E731
        return {"rate": rate, "requests": rng.randint(5, 50), "req_per_s": rng.random(), "ttft_ms": f(),
                "tpot_ms": f(), "e2e_ms": f(), "server_mean_ms": {"ttft": rng.random(), "decode": None}}

    rounds = [[row(1.0), row(4.0)] for _ in range(3)]
    merged = bench.merge_rounds(rounds)
    assert [m["rate"] for m in merged] == [1.0, 4.0]
    for i, m in enumerate(merged):
        mine = [r[i] for r in rounds]
        assert m["rounds"] == mine and m["requests"] == sum(r["requests"] for r in mine)
        for key, q in (("ttft_ms", "p50"), ("tpot_ms", "p99"), ("e2e_ms", "p50"), ("server_mean_ms", "ttft")):
            assert m[key][q] == sorted(r[key][q] for r in mine)[1]
        assert m["server_mean_ms"]["decode"] is None


@pytest.mark.parametrize("extra,message", [
    (["--rounds", "0"], "--rounds and --restarts must be at least 1, not 0 and 1"),
    (["--restarts", "0"], "--rounds and --restarts must be at least 1, not 1 and 0"),
    (["--rounds", "2", "--restarts", "2"], "two ways of repeating: give one"),
])
def test_rounds_and_restarts_below_one_or_both_are_refused(extra, message):
    sys_argv, sys.argv = sys.argv, ["bench_serving.py", "--model", "/m", *extra]
    try:
        with pytest.raises(ValueError, match=re.escape(message)):
            bench.main()
    finally:
        sys.argv = sys_argv


def test_restarts_alternate_the_order_of_the_servers():
    assert bench.alternating(["default", "relay", "sglang"], 4) == [
        ["default", "relay", "sglang"], ["sglang", "relay", "default"],
        ["default", "relay", "sglang"], ["sglang", "relay", "default"]]
    assert bench.alternating(["relay"], 2) == [["relay"], ["relay"]]


def test_restarts_start_every_server_again_each_round_and_merge_the_rounds(monkeypatch, tmp_path):
    """--restarts 3: six servers, one at a time, in alternating order, each its own log; per configuration
    the median of its three rounds, the rounds kept, and the results saved after every server."""
    started, figures = [], iter(range(100))

    class FakeServer:
        def __init__(self, args, config, systems, log_dir, share=None, log_suffix=""):
            self.config = config
            started.append((config, log_suffix, share))

        async def wait(self, session, args, request):
            pass

        def stop(self):
            started.append(("stopped", self.config))

    async def fake_rates(session, server, args, request):
        t = float(next(figures))
        return [{"rate": 1.0, "requests": 2, "req_per_s": 1.0, "ttft_ms": {"p50": t, "p99": t},
                 "tpot_ms": {"p50": 5.0, "p99": 5.0}, "e2e_ms": {"p50": 1.0, "p99": 1.0},
                 "server_mean_ms": {"ttft": t}}]

    monkeypatch.setattr(bench, "Server", FakeServer)
    monkeypatch.setattr(bench, "run_rates", fake_rates)
    saved = []
    out = asyncio.run(bench.bench(args("--restarts", "3"), ["default", "relay"], [], None, str(tmp_path),
                                  saved.append))
    servers = [s for s in started if s[0] != "stopped"]
    assert servers == [("default", "_1", None), ("relay", "_1", None), ("relay", "_2", None),
                       ("default", "_2", None), ("default", "_3", None), ("relay", "_3", None)]
    assert started[1] == ("stopped", "default")  # each stopped before the next starts
    assert [r["ttft_ms"]["p50"] for r in out["default"][0]["rounds"]] == [0.0, 3.0, 4.0]
    assert out["default"][0]["ttft_ms"]["p50"] == 3.0 and out["relay"][0]["ttft_ms"]["p50"] == 2.0
    assert out["relay"][0]["requests"] == 6 and len(saved) == 6 and saved[-1] == out


def test_one_round_keeps_the_rows_as_they_are(monkeypatch, tmp_path):
    class FakeServer:
        def __init__(self, args, config, systems, log_dir, share=None, log_suffix=""):
            self.config, self.suffix = config, log_suffix

        async def wait(self, session, args, request):
            pass

        def stop(self):
            assert self.suffix == ""

    async def fake_rates(session, server, args, request):
        return [{"rate": 1.0, "config": server.config}]

    monkeypatch.setattr(bench, "Server", FakeServer)
    monkeypatch.setattr(bench, "run_rates", fake_rates)
    out = asyncio.run(bench.bench(args(), ["default", "relay"], [], None, str(tmp_path), lambda r: None))
    assert out == {"default": [{"rate": 1.0, "config": "default"}], "relay": [{"rate": 1.0, "config": "relay"}]}
