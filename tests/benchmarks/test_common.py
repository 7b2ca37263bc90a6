"""benchmarks/common.py: running one configuration's process and reading back its result."""

import json
import sys

from tests.benchmarks import load

common = load("common")


def test_model_config_reads_the_folders_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 32000}))
    assert common.model_config(str(tmp_path))["vocab_size"] == 32000


def test_result_line_is_the_workers_result_and_none_without_one():
    log = "INFO starting\nRESULT {\"config\": \"relay\", \"single\": {\"requests_per_s\": 7.5}}\nINFO done\n"
    assert common.result_line(log) == {"config": "relay", "single": {"requests_per_s": 7.5}}
    assert common.result_line("Traceback (most recent call last):\n") is None


def test_run_logged_keeps_the_log_beside_out_and_returns_the_exit_code(tmp_path):
    args = type("Args", (), {"out": str(tmp_path / "r.json"), "profile": None})()
    cmd = [sys.executable, "-c", "import sys; print('RESULT {\"x\": 1}'); sys.exit(3)"]
    log, rc = common.run_logged(cmd, args, "relay")
    assert rc == 3 and common.result_line(log) == {"x": 1}
    assert (tmp_path / "r.relay.log").read_text() == log


def test_worker_command_repeats_this_run_for_one_config(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_x.py", "--model", "m", "--out", "o.json"])
    assert common.worker_command("/b/bench_x.py", "noprefix") == [
        sys.executable, "/b/bench_x.py", "--model", "m", "--out", "o.json", "--worker", "noprefix"]
