"""How fast a bad relay configuration stops the OpenAI server, and how much of that is vLLM's imports.

tests/hooks/test_frontend.py checks that a system prompt over max_prompt_tokens stops the server in
the front end, before any engine starts; a test cannot bound the time (it depends on the machine),
so it is measured here. Each run starts that server (tiny-llama-gqa, a 308-token chat system prompt
against max_prompt_tokens=256), checks it exited non-zero with the message and no engine, and
times it; the import of vllm.entrypoints.openai.api_server alone is timed as often, in a fresh
interpreter each time. Prints median, min and max seconds of each as a markdown table.
Usage: python benchmarks/bench_startup_error.py [--runs 3] [--out DIR]
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from vllm_relay.testing.models import get_model
from vllm_relay.testing.server import free_port

RELAY = {"max_prompt_tokens": 256, "system_prompts": {"support": {"chat_system": "word " * 300}}}
MESSAGE = "ValueError: system prompt 'support': 308 tokens, more than max_prompt_tokens=256"


def server_cmd() -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", get_model("tiny-llama-gqa"), "--attention-backend", "relay", "--max-model-len", "512",
            "--port", str(free_port()), "--additional-config", json.dumps({"relay": RELAY})]


def timed(cmd: list[str], bad_config: bool) -> float:
    """Seconds `cmd` ran; exits with the log tail if it did not behave."""
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    elapsed = time.monotonic() - start
    log = proc.stdout + proc.stderr
    no_engine = "EngineCore" not in log and "Loading weights" not in log
    ok = proc.returncode != 0 and MESSAGE in log and no_engine if bad_config else proc.returncode == 0
    if not ok:
        sys.exit(f"{' '.join(cmd[1:4])}: unexpected (exit code {proc.returncode}); log tail:\n{log[-3000:]}")
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", help="a folder for startup_error.json and startup_error.md")
    args = p.parse_args()
    cases = {
        "bad config: server exits": (server_cmd, True),
        "import vllm.entrypoints.openai.api_server": (
            lambda: [sys.executable, "-c", "import vllm.entrypoints.openai.api_server"], False),
    }
    times = {name: [] for name in cases}
    for i in range(args.runs):  # interleaved: a machine that slows down meanwhile slows both
        for name, (cmd, bad_config) in cases.items():
            times[name].append(timed(cmd(), bad_config))
            print(f"run {i + 1}/{args.runs}: {name}: {times[name][-1]:.1f} s", flush=True)
    rows = {name: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "runs_s": t}
            for name, t in times.items()}
    markdown = "| what | median s | min s | max s |\n|---|---|---|---|\n" + "".join(
        f"| {name} | {r['median_s']:.1f} | {r['min_s']:.1f} | {r['max_s']:.1f} |\n"
        for name, r in rows.items())
    print(markdown, end="")
    if args.out:
        import vllm

        env = {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
               "vllm": vllm.__version__}
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "startup_error.json"), "w") as f:
            json.dump({"env": env, "runs": args.runs, "results": rows}, f, indent=1)
        with open(os.path.join(args.out, "startup_error.md"), "w") as f:
            f.write(markdown)


if __name__ == "__main__":
    main()
