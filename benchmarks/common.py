"""Helpers shared by the end-to-end benchmarks (bench_throughput.py, bench_serving.py,
bench_sharing.py). Each script runs every configuration in a process of its own: the parent
starts `<script> ... --worker CONFIG`, keeps its log beside `--out` and reads the one line it
prints as `RESULT {json}`."""

import glob
import json
import os
import subprocess
import sys


def model_config(model: str) -> dict:
    """The model folder's config.json (the shape models carry one, as a real checkpoint does)."""
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)


def profile_dir(args, config: str) -> str:
    """Where vLLM's torch profiler writes for `config`: `<out>.<config>.profile/`."""
    return os.path.abspath(f"{os.path.splitext(args.out or 'bench')[0]}.{config}.profile")


def profiler_config(args, config: str) -> dict:
    """vLLM's torch profiler over a window of the first run's steps (`--profile DELAY,STEPS`)."""
    delay, steps = map(int, args.profile.split(","))
    return dict(profiler="torch", torch_profiler_dir=profile_dir(args, config), delay_iterations=delay,
                max_iterations=steps, torch_profiler_with_stack=False)


def drop_traces(args, config: str) -> None:
    """Keep vLLM's kernel table (profiler_out_0.txt), not the traces (hundreds of MB each)."""
    for trace in glob.glob(os.path.join(profile_dir(args, config), "*.pt.trace.json*")):
        os.remove(trace)


def run_logged(cmd: list[str], args, config: str, env: dict | None = None) -> tuple[str, int]:
    """Run one configuration's process: (its output, exit code). Its log is kept beside `--out`
    as `<out>.<config>.log` (vLLM's step statistics and warnings); profiler traces are dropped."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    log = proc.stdout + proc.stderr
    if args.out:
        with open(f"{os.path.splitext(args.out)[0]}.{config}.log", "w") as f:
            f.write(log)
    if getattr(args, "profile", None):
        drop_traces(args, config)
    return log, proc.returncode


def result_line(log: str) -> dict | None:
    """The worker's `RESULT {json}` line, parsed (None if it printed none)."""
    for line in log.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return None


def worker_command(script: str, config: str) -> list[str]:
    """This run's command line again, as the worker of one configuration."""
    return [sys.executable, script, *sys.argv[1:], "--worker", config]
