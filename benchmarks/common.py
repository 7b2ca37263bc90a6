"""Helpers shared by the end-to-end benchmarks (bench_throughput.py, bench_interleaved.py,
bench_serving.py, bench_sharing.py). Each script runs every configuration in a process of its own: the
parent starts `<script> ... --worker CONFIG`, keeps its log beside `--out` and reads back what it
prints (`RESULT {json}`). The offline throughput workloads (`single`, `multi`), their sampling and
each configuration's engine arguments are here too, so that every script measures the same requests;
the OpenAI servers bench_serving.py starts (vLLM's, relay's, SGLang's); a profiled run's traces left as text
(traces.py); and, last, how the kernel benchmarks (bench_ops.py,
bench_window.py, bench_mla.py) take their command line, time an op on the GPU and read the card's limits and
the host's speed."""

import asyncio
import functools
import glob
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from traces import drop_traces  # noqa: E402


def model_config(model: str) -> dict:
    """The model folder's config.json (the shape models carry one, as a real checkpoint does), its
    language model's settings first: a multimodal checkpoint (Qwen2.5-VL) keeps its layers, heads and
    vocabulary under `text_config`."""
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    return {**c, **c.get("text_config", {})}


MEDIA_TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


def attention_shape(config: dict) -> dict:
    """A model config's (`model_config`) attention: its layers, query and KV heads, and head size."""
    hd = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return {"layers": config["num_hidden_layers"], "hq": config["num_attention_heads"],
            "hkv": config["num_key_value_heads"], "head_dim": hd}


def prompt_vocab(config: dict) -> int:
    """The end of the token ids a random prompt draws from: the vocabulary, less the multimodal
    placeholders at its top (Qwen2.5-VL's image and video tokens, which vLLM refuses without their data)."""
    return min([config["vocab_size"]] + [config[k] for k in MEDIA_TOKEN_KEYS if k in config])


def random_prompt(rng, length: int, vocab: int) -> list[int]:
    """BOS and `length` - 1 ids drawn from `rng` in [100, vocab): past the special tokens at the start of
    the vocabulary, below `prompt_vocab`'s end."""
    return [1] + [rng.randrange(100, vocab) for _ in range(length - 1)]


def profile_dir(args, config: str) -> str:
    """Where vLLM's torch profiler writes for `config`: `<out>.<config>.profile/`."""
    return os.path.abspath(f"{os.path.splitext(args.out or 'bench')[0]}.{config}.profile")


def profiler_config(args, config: str) -> dict:
    """vLLM's torch profiler over a window of the first run's steps (`--profile DELAY,STEPS`)."""
    delay, steps = map(int, args.profile.split(","))
    return dict(profiler="torch", torch_profiler_dir=profile_dir(args, config), delay_iterations=delay,
                max_iterations=steps, torch_profiler_with_stack=False)


def triton_cache_dirs() -> list[str]:
    """Every Triton cache a run's processes may compile into: TRITON_CACHE_DIR, Triton's default
    (~/.triton/cache), and those vLLM's compiler points its engine at when none is set (under its
    cache root's torch_compile_cache)."""
    home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
    root = os.environ.get("VLLM_CACHE_ROOT") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "vllm")
    dirs = [os.environ.get("TRITON_CACHE_DIR"), os.path.join(home, ".triton", "cache"),
            *glob.glob(os.path.join(root, "torch_compile_cache", "**", "triton_cache"), recursive=True)]
    return [d for d in dict.fromkeys(dirs) if d and os.path.isdir(d)]


def compiled_during(t0: float, t1: float, dirs: list[str] | None = None) -> list[str]:
    """Triton kernels (of any process of this run) compiled between wall times t0 and t1, in `dirs`
    (default `triton_cache_dirs()`): a compilation inside a timed run is start-up work that leaked into
    the measurement. A kernel a warm cache held is loaded, not compiled, and not listed."""
    names = []
    for cache in triton_cache_dirs() if dirs is None else dirs:
        for entry in os.scandir(cache):
            for f in os.scandir(entry.path) if entry.is_dir() else ():
                kernel = f.name.endswith(".json") and not f.name.startswith("__grp__")
                if kernel and t0 <= f.stat().st_mtime <= t1:
                    names.append(f.name[:-5])
    return sorted(names)


# Every Triton compile after the engine's warm-up logged, each with its constants and signature (by default
# vLLM logs a kernel's first only): what `jit_compiled` reads, and what tells a variant from another.
JIT_MONITOR = {"jit_monitor_verbose": True}
JIT_LINE = re.compile(r"Triton kernel JIT compilation during inference: (\w+)")


def jit_compiled(log: str) -> list[str]:
    """The Triton kernels vLLM's JIT monitor saw compiled after the engine's warm-up (its `jit_monitor`
    warnings in a process's log): in any run of the process, the benchmark's own warm-up runs included.
    Unlike `compiled_during` it misses no cache folder, but places a compile only in the process."""
    return JIT_LINE.findall(log)


def decode_span_s(outs) -> float | None:
    """The median request's seconds from its first token to its last, by the timestamps vLLM keeps with its
    stats on (`RequestOutput.metrics`): a job's decode after its own first token, prefill excluded. None
    where no request has them."""
    spans = [o.metrics.last_token_ts - o.metrics.first_token_ts for o in outs
             if getattr(o, "metrics", None) is not None and o.metrics.first_token_ts > 0]
    return statistics.median(spans) if spans else None


def run_logged(cmd: list[str], args, config: str, env: dict | None = None) -> tuple[str, int]:
    """Run one configuration's process: (its output, exit code). Its log is kept beside `--out`
    as `<out>.<config>.log` (vLLM's step statistics and warnings); profiler traces are dropped."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    log = proc.stdout + proc.stderr
    if args.out:
        with open(f"{os.path.splitext(args.out)[0]}.{config}.log", "w") as f:
            f.write(log)
    if getattr(args, "profile", None):
        drop_traces(profile_dir(args, config))
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


def add_sglang_args(p) -> None:
    """Where the `sglang` configuration finds SGLang, and more of its engine arguments."""
    p.add_argument("--sglang-env", default="/tmp/site-sglang/env.sh", help="the sglang configuration's "
                   "environment (written by tools/gpu_host/sglang/install.sh)")
    p.add_argument("--sglang-args", help="more sglang.Engine arguments, as JSON "
                   "(e.g. '{\"attention_backend\": \"fa3\"}')")


def in_sglang_env(args, cmd: list[str]) -> list[str]:
    """`cmd` run in SGLang's environment (`--sglang-env`: its PYTHONPATH in front of vLLM's site)."""
    return ["bash", "-c", f'. "{args.sglang_env}" && exec "$@"', "sglang", *cmd]


def sglang_command(script: str, args) -> list[str]:
    """The `sglang` configuration's worker, in SGLang's environment."""
    return in_sglang_env(args, worker_command(script, "sglang"))


def sglang_engine(args, **kw):
    """SGLang's offline `Engine` on the model with dummy weights, its radix cache on, its default attention
    backend and CUDA graphs, PyTorch sampling (vLLM samples without FlashInfer on the GPU host too:
    VLLM_USE_FLASHINFER_SAMPLER=0); `kw` and `--sglang-args` on top. Returns (engine, its arguments)."""
    import sglang

    kw = dict(model_path=args.model, load_format="dummy", context_length=args.max_model_len,
              random_seed=args.seed, tp_size=getattr(args, "tensor_parallel_size", 1), log_level="info",
              sampling_backend="pytorch", **kw)
    if getattr(args, "sglang_args", None):
        kw.update(json.loads(args.sglang_args))
    return sglang.Engine(**kw), kw


def sglang_sampling(max_tokens: int, n: int = 1) -> dict:
    """The throughput workloads' sampling (`sampling_params`), in SGLang's terms."""
    return {"n": n, "max_new_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0, "ignore_eos": True}


def json_object(text: str) -> dict:
    """An argument given as a JSON object."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object: {text}")
    return value


def add_workload_args(p) -> None:
    """The model and the throughput workloads' sizes (what `workload` and `engine_kwargs` read)."""
    p.add_argument("--model", required=True)
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--multi-system-lens", default="512,1024,2048,4096", help="the multi workload's prompts")
    p.add_argument("--engine-args", type=json_object, default={}, help="more vLLM engine arguments for every "
                   "vLLM configuration, as JSON (e.g. '{\"kv_cache_dtype\": \"fp8\"}': a feature on for both sides)")


def sample_requests(args):
    """vLLM's random dataset, tokenized: (prompt token ids per request, output lengths)."""
    from vllm.benchmarks.datasets import RandomDataset
    from vllm.tokenizers import get_tokenizer

    tok = get_tokenizer(args.model)
    reqs = RandomDataset(random_seed=args.seed).sample(
        tokenizer=tok, num_requests=args.num_prompts, prefix_len=args.prefix_len,
        input_len=args.input_len, output_len=args.output_len)
    return [tok.encode(r.prompt) for r in reqs], [r.expected_output_len for r in reqs]


def multi_requests(args):
    """The multi-prompt workload: (system prompts, prompts, output lengths); 20% plain requests."""
    import random

    rng = random.Random(args.seed + 1)
    vocab = prompt_vocab(model_config(args.model))
    lens = [int(n) for n in args.multi_system_lens.split(",")]
    systems = [random_prompt(rng, n, vocab) for n in lens]
    prompts, out_lens = [], []
    for _ in range(args.num_prompts):
        own = [rng.randrange(100, vocab) for _ in range(rng.randint(64, 256))]
        prompts.append([1] + own if rng.random() < 0.2 else rng.choice(systems) + own)
        out_lens.append(rng.randint(128, 384))
    return systems, prompts, out_lens


def workload(args, name):
    """(system prompts, prompts, output lengths) of workload `name`."""
    if name == "single":
        from vllm_relay.system_prompts.fill import common_prefix

        prompts, out_lens = sample_requests(args)
        return [functools.reduce(common_prefix, prompts)], prompts, out_lens
    return multi_requests(args)


def strip_system(prompts, systems):
    """The same requests with no system prompt: BOS and the request's own tokens."""
    out = []
    for p in prompts:
        n = max((len(s) for s in systems if p[: len(s)] == s), default=1)
        out.append(p[:1] + p[n:])
    return out


def engine_kwargs(args, config, systems):
    # Stats on: the latency sweep reads each request's engine timestamps (the same cost for every config).
    kw = dict(model=args.model, load_format="dummy", max_model_len=args.max_model_len, seed=args.seed,
              disable_log_stats=False, tensor_parallel_size=args.tensor_parallel_size,
              enable_logging_iteration_details=args.iteration_details, **JIT_MONITOR)
    if args.gpu_memory_utilization:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.max_num_seqs:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.max_cudagraph_capture_size:
        kw["compilation_config"] = {"max_cudagraph_capture_size": args.max_cudagraph_capture_size}
    if config == "noprefix-relay":
        kw["attention_backend"] = "relay"
    elif config in ("relay", "accuracy-relay"):
        kw["attention_backend"] = "relay"
        relay = {"system_prompts": {f"s{i}": ids for i, ids in enumerate(systems)}, "max_prompts": len(systems),
                 "max_prompt_tokens": max(map(len, systems))}
        if args.shared_path:
            relay["shared_path"] = args.shared_path
        kw["additional_config"] = {"relay": relay}
    elif config == "accuracy-reference":
        kw["attention_backend"] = "FLASH_ATTN"
    if args.profile:
        kw["profiler_config"] = profiler_config(args, config)
    return {**kw, **args.engine_args}


def sampling_params(out_lens: list[int]) -> list:
    """The throughput workloads' sampling: random tokens, each request exactly its output length."""
    from vllm import SamplingParams

    return [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=n) for n in out_lens]


# ---- OpenAI servers (bench_serving.py): each configuration's command line, environment and process ----

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# "-full": the same server with full CUDA graphs for every batch, prompt chunks too (vLLM's
# `cudagraph_mode=FULL`; its default graphs only decodes whole and runs the rest piecewise).
CONFIGS = ("default", "relay", "relay-plain", "sglang", "default-full", "relay-full")
FULL_GRAPHS = json.dumps({"cudagraph_mode": "FULL"})


def check_config(config: str) -> None:
    if config not in CONFIGS:
        raise ValueError(f"unknown config {config!r}: one of {', '.join(CONFIGS)}")


def gpu_share(args, n_servers: int) -> str | None:
    """Each server's --gpu-memory-utilization when several share the GPU (None: vLLM's default, or the
    user's own in --server-args)."""
    if n_servers == 1 or "--gpu-memory-utilization" in args.server_args:
        return None
    return f"{0.88 / n_servers:.2f}"


def server_command(args, config, systems, port, gpu: bool, share: str | None = None) -> list[str]:
    """The server's command line for one configuration (`share`: its --gpu-memory-utilization)."""
    check_config(config)
    if config == "sglang":
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", args.model,
               "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m",
               "--context-length", str(args.max_model_len), "--random-seed", str(args.seed),
               "--load-format", "dummy", "--sampling-backend", "pytorch",
               *args.sglang_server_args.split()]
        return in_sglang_env(args, cmd + (["--mem-fraction-static", share] if share is not None else []))
    entry = ["-m", "vllm.entrypoints.cli.main", "serve", args.model] if gpu else \
            ["-m", "vllm.entrypoints.openai.api_server", "--model", args.model]
    cmd = [sys.executable, *entry, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "m",
           "--max-model-len", str(args.max_model_len), "--seed", str(args.seed), *args.server_args.split()]
    if gpu:
        cmd += ["--load-format", "dummy"]
    if share is not None:
        cmd += ["--gpu-memory-utilization", share]
    if config.startswith("relay"):
        cmd += ["--attention-backend", "relay"]
    if config.endswith("-full"):
        cmd += ["--compilation-config", FULL_GRAPHS]
    if config in ("relay", "relay-full"):
        relay = {"system_prompts": {f"s{i}": ids for i, ids in enumerate(systems)}, "max_prompts": len(systems),
                 "max_prompt_tokens": max(map(len, systems))}
        cmd += ["--additional-config", json.dumps({"relay": relay})]
    return cmd


def server_env(config: str) -> dict | None:
    """A relay server's environment as docs/serving.md configures it: `VLLM_PLUGINS=relay` loads relay's
    endpoint plugin (its routes, /metrics series and chat middleware) beside the general one; a
    VLLM_PLUGINS of the caller's own is kept. None (the caller's environment) for the others."""
    if not config.startswith("relay") or "VLLM_PLUGINS" in os.environ:
        return None
    return {**os.environ, "VLLM_PLUGINS": "relay"}


def start_server(args, config, systems, port, log_path, share=None):
    cmd = server_command(args, config, systems, port, has_gpu(), share)
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=server_env(config))
    return proc, log


def has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        return False


async def wait_healthy(session, base, proc, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during start-up")
        try:
            async with session.get(f"{base}/health") as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        await asyncio.sleep(1)
    raise RuntimeError("server did not become healthy")


def kernel_args(doc: str, quick: str, out: str = "/tmp/out", more=None):
    """The kernel benchmarks' command line (its description the first line of `doc`): --out DIR, --quick
    (`quick` says what it keeps), --rep (do_bench's milliseconds per op); `more(parser)` adds a
    benchmark's own."""
    import argparse

    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--out", default=out)
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--rep", type=int, default=100, help="do_bench repetition time per op, ms")
    if more is not None:
        more(p)
    return p.parse_args()


def capture_graph(fn):
    """`fn` captured in a CUDA graph, after one warm-up call on a side stream (as torch asks)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_ms(fn, rep: int = 100, eager_fallback: bool = False) -> tuple[float, str]:
    """Median ms of `fn`'s CUDA-graph replays (triton.testing.do_bench, L2 flushed between them), and
    "graph". With `eager_fallback`, an op that cannot be captured is timed as eager launches ("eager")."""
    import torch
    import triton

    fn()
    fn()
    torch.cuda.synchronize()
    try:
        run, mode = capture_graph(fn).replay, "graph"
    except Exception as e:  # noqa: BLE001 - reported; timed eagerly when asked, else raised
        if not eager_fallback:
            raise
        print(f"  (CUDA graph capture failed: {type(e).__name__}: {e}; timing eager launches)")
        run, mode = fn, "eager"
    return triton.testing.do_bench(run, warmup=25, rep=rep, return_mode="median"), mode


def host_speed_us(rounds: int = 9) -> float:
    """The median time (us) of a fixed piece of pure Python (dict stores, tuples, str): the host's speed for
    the interpreter's own work, which a host-bound step is made of (GPU hosts differ by 1.5x and more)."""
    def work():
        d = {}
        for i in range(20000):
            d[i & 255] = (i, str(i))
        return d

    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        work()
        times.append(time.perf_counter() - t)
    return round(statistics.median(times) * 1e6, 1)


def measure_card() -> dict:
    """Copy bandwidth (bytes read + written per second) and bf16 matmul rate, measured once, and the
    host's speed for pure Python (`host_speed_us`)."""
    import torch
    import triton

    def timed():  # its buffers are freed when it returns
        x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
        return (triton.testing.do_bench(lambda: y.copy_(x), return_mode="median"),
                triton.testing.do_bench(lambda: a @ a, return_mode="median"))

    copy_ms, mm_ms = timed()
    # A benchmark process stays alive beside the engines it starts: hand its buffers back (on an 80 GB
    # card the 3.2 GiB it held made a relay engine at 0.92 of the GPU run out of memory, H100, 2026-11-26).
    torch.cuda.empty_cache()
    return {"copy_bytes_per_s": 2 * (1 << 30) / copy_ms * 1e3, "bf16_flop_per_s": 2 * 8192 ** 3 / mm_ms * 1e3,
            "device": torch.cuda.get_device_name(), "host_speed_us": host_speed_us()}
