"""Relay's host work per step: the runner hook and the planner, at up to 1024 running requests.

Every step, before its graph replays, relay runs on the CPU: the runner hook (`attention.step.prepare`:
each request's system slot and position shift, vLLM's host block table), the level search
(`RelayPlanner.levels_for`: the tree of shared pages, `ops.find_levels`) and the plan
(`RelayPlanner.plan`: the context and level tables, one host-to-device copy, the table kernels'
launches). vLLM's async scheduling overlaps that work with the previous step's GPU time only while
the host keeps ahead; the accounting (`account.py`) shows relay's decode steps waiting longer on the
host than the baseline's. This times each phase on a model runner's stand-in (vLLM's own
`CpuGpuBuffer` and `CommonAttentionMetadata`, the planner as the backend builds it), for decode
batches of the Llama-2-7B head layout (block size 16):

  plain       nothing registered, nothing shared (the prefix cache finds nothing): what plain
              traffic pays with relay on
  registered  every request under one registered system prompt of P tokens, own pages unshared
  samples     groups of 16 samples of one prompt of P tokens (the prefix cache shares its pages)
  tree        a registered prompt of P tokens over documents of 512 tokens, 16 samples each
  mixed       registered, and beside the decodes `--chunks` prompt chunks of 128 tokens (new requests under
              the prompt): a prefill step of the throughput runs, eager (no full CUDA graph)

Host time is the point: CUDA launches are counted as their host cost (no synchronisation).
Figures in the results come from the GPU host (`--device cuda`); on a CPU-only machine the plan's
table kernels run in torch, so only `prepare` and `levels` compare (with the GPU's level rule).
Usage: python benchmarks/bench_host.py [--device cuda] [--reqs 256,1024] [--prompt 2048] [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch

# vllm_relay first, from the path (PYTHONPATH=.old for an earlier one): bench_layer puts this
# checkout first on sys.path.
from vllm_relay import protocol
from vllm_relay.attention import planner as planner_module
from vllm_relay.attention import step as relay_step
from vllm_relay.attention.planner import RelayPlanner

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_layer import write_results  # noqa: E402

PAGE, HEADS, HEAD_SIZE, OWN_IN, OWN_OUT = 16, 32, 128, 128, 256
MAX_REQS, MAX_MODEL_LEN = 1024, 20480
SCENARIOS = ("plain", "registered", "samples", "tree", "mixed")
MAX_BATCHED = 16384  # the throughput runs' steps (vLLM's default for them)
MAX_TOKENS = 32768


def planner_config(device: torch.device, prompt: int) -> SimpleNamespace:
    """The parts of a VllmConfig the planner reads: Llama-2-7B heads, full CUDA graphs up to 1024."""
    mode = SimpleNamespace(has_full_cudagraphs=lambda: True)
    model = SimpleNamespace(get_num_attention_heads=lambda _p: HEADS, get_num_kv_heads=lambda _p: HEADS,
                            get_head_size=lambda: HEAD_SIZE, max_model_len=MAX_MODEL_LEN,
                            dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    relay = {"max_prompts": 4, "max_prompt_tokens": max(prompt, PAGE), "shared_path": "auto"}
    return SimpleNamespace(
        additional_config={"relay": relay}, model_config=model, parallel_config=None,
        scheduler_config=SimpleNamespace(max_num_seqs=MAX_REQS, max_num_batched_tokens=MAX_BATCHED),
        compilation_config=SimpleNamespace(cudagraph_mode=mode, max_cudagraph_capture_size=MAX_REQS))


def decode_batch(scenario: str, B: int, prompt: int, seed: int = 0, chunks: int = 0):
    """(block table [B + chunks, W], KV tokens [B + chunks] after this step, slot, shift, tokens this step)
    of a decode batch whose requests are part-way through their 256 output tokens, and `chunks` requests
    computing their first 128 tokens."""
    rng = np.random.default_rng(seed)
    width = -(-MAX_MODEL_LEN // PAGE)
    table = np.zeros((MAX_REQS, width), dtype=np.int32)
    own = np.concatenate([OWN_IN + rng.integers(1, OWN_OUT, B), np.full(chunks, OWN_IN)])  # the step's tokens in
    q_lens = np.concatenate([np.ones(B, np.int32), np.full(chunks, OWN_IN, np.int32)])
    B += chunks
    if int(q_lens.sum()) > MAX_BATCHED:
        raise ValueError(f"{B - chunks} decodes and {chunks} chunks of {OWN_IN} tokens exceed a step's {MAX_BATCHED}")
    shared = {"plain": 0, "registered": 0, "samples": prompt, "tree": 512}[scenario]
    group = {"plain": 1, "registered": 1, "samples": 16, "tree": 16}[scenario]
    seq = (shared + own).astype(np.int32)
    ids = iter(rng.permutation(10 * B * width // 8).astype(np.int32))
    for r in range(B):
        n = -(-int(seq[r]) // PAGE)
        table[r, :n] = [next(ids) for _ in range(n)]
    head = shared // PAGE
    for r in range(B):  # the prefix cache's sharing: a group's rows hold its first row's pages
        table[r, :head] = table[r - r % group, :head]
    registered = scenario in ("registered", "tree")
    slot = np.full(B, 0 if registered else -1, dtype=np.int32)
    shift = np.full(B, prompt if registered else 0, dtype=np.int32)
    return table, seq, slot, shift, q_lens


def runner_stand_in(table, seq, slot, shift, q_lens, device):
    """What `step.prepare` reads of vLLM's GPUModelRunner."""
    from vllm.v1.utils import CpuGpuBuffer

    B = seq.shape[0]
    states, ids = {}, []
    for r in range(B):
        extra = None
        if slot[r] >= 0:
            extra = protocol.tag(None, protocol.RelayTag(int(slot[r]), int(shift[r])))
        ids.append(f"req-{r}")
        states[ids[-1]] = SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra), block_ids=([],))
    computed = np.zeros(MAX_REQS, dtype=np.int32)
    computed[:B] = seq - q_lens
    batch = SimpleNamespace(num_reqs=B, req_ids=ids, num_computed_tokens_cpu=computed,
                            block_table=SimpleNamespace(block_tables=[SimpleNamespace(
                                block_table=SimpleNamespace(np=table))]))
    pin = device.type == "cuda"
    return SimpleNamespace(
        input_batch=batch, requests=states, max_num_tokens=MAX_TOKENS,
        positions=torch.zeros(MAX_TOKENS, dtype=torch.int64, device=device),
        _make_buffer=lambda *size, dtype: CpuGpuBuffer(*size, dtype=dtype, device=device, pin_memory=pin))


def attention_metadata(table, seq, q_lens, device):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    B, T = seq.shape[0], int(q_lens.sum())
    cu = torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    return CommonAttentionMetadata(
        query_start_loc=cu.to(device), query_start_loc_cpu=cu, seq_lens=torch.from_numpy(seq).to(device),
        num_reqs=B, num_actual_tokens=T, max_query_len=int(q_lens.max()), max_seq_len=int(seq.max()),
        block_table_tensor=torch.from_numpy(table[:B]).to(device),
        slot_mapping=torch.zeros(T, dtype=torch.int64, device=device))


def one_step(runner, planner, cm, counts):
    """The host work of one step, phase by phase (seconds); a decode step replays a full graph."""
    t0 = time.perf_counter()
    relay_step.prepare(runner, counts, planner.pages, PAGE)
    t1 = time.perf_counter()
    step = relay_step._current
    planner.levels_for(step)
    relay_step.dispatched(cm.max_query_len == 1, step.tree is not None)  # what vLLM's graph dispatcher records
    t2 = time.perf_counter()
    planner.plan(cm, step)
    t3 = time.perf_counter()
    relay_step.clear()
    return t1 - t0, t2 - t1, t3 - t2, step


def profile_steps(runner, planner, cm, counts, steps: int, path: str) -> None:
    """`steps` more steps under cProfile, the 30 costliest functions (own time) written to `path`,
    then relay's own 30: which call of a phase the host time goes to."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        one_step(runner, planner, cm, counts)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text).sort_stats("tottime")
    stats.print_stats(30)
    stats.print_stats("vllm_relay", 30)
    with open(path, "w") as f:
        f.write(text.getvalue())


def bench(scenario, B, prompt, device, steps, chunks=0, profile_dir=None):
    mixed = scenario == "mixed"
    table, seq, slot, shift, q_lens = decode_batch("registered" if mixed else scenario, B, prompt,
                                                   chunks=chunks if mixed else 0)
    planner = RelayPlanner(planner_config(device, prompt), SimpleNamespace(block_size=PAGE), device)
    planner.pages.record(0, list(range(10**6, 10**6 + prompt // PAGE)))
    runner = runner_stand_in(table, seq, slot, shift, q_lens, device)
    cm = attention_metadata(table, seq, q_lens, device)
    times = [one_step(runner, planner, cm, q_lens) for _ in range(steps + 10)][10:]
    if profile_dir:
        profile_steps(runner, planner, cm, q_lens, steps,
                      os.path.join(profile_dir, f"host_profile_{scenario}_{B}{f'_{chunks}' if mixed else ''}.txt"))
    step = times[-1][3]
    tree = step.tree
    if device.type == "cuda":
        torch.cuda.synchronize()
    phases = {name: statistics.median(t[i] for t in times) * 1e6
              for i, name in enumerate(("prepare", "levels", "plan"))}
    return dict(scenario=scenario, requests=B, chunks=chunks if mixed else 0, prompt=prompt, steps=steps,
                **{f"{k}_us": round(v, 1) for k, v in phases.items()},
                total_us=round(sum(phases.values()), 1), levels=0 if tree is None else tree.num_groups,
                level_rows=0 if tree is None else int((tree.row_groups >= 0).sum()))


def markdown(env, rows) -> str:
    lines = [f"# Relay's host work per step ({env['device']})", "",
             f"Medians of {rows[0]['steps']} steps, microseconds; {env['cpu']}.", "",
             "| scenario | requests | P | prepare | levels | plan | total | levels found | level rows |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r[k] for k in ("scenario", "requests", "prompt", "prepare_us", "levels_us", "plan_us")]
        if r.get("chunks"):
            cells[0] = f"{r['scenario']} (+{r['chunks']} chunks)"
        cells += [f"**{r['total_us']}**", r["levels"], r["level_rows"]]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reqs", default="256,1024")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--chunks", type=int, default=120, help="mixed: prompt chunks of 128 tokens beside the decodes "
                    "(requests + 128 x chunks <= 16384, a step's tokens)")
    ap.add_argument("--profile", action="store_true", help="also each point's steps under cProfile, the costliest "
                    "functions in <out>/host_profile_<scenario>_<requests>[_<chunks>].txt")
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.profile:
        os.makedirs(args.out, exist_ok=True)
    rule = planner_module.MIN_SAVED_TOKENS
    gpu_rule = {("cpu", gqa): rule["cuda", gqa] for gqa in (False, True)}
    rows = []
    # On the CPU, the GPU's rule: the level search runs as it does there.
    with mock.patch.dict(rule, gpu_rule if device.type == "cpu" else {}):
        for scenario in args.scenarios.split(","):
            for B in map(int, args.reqs.split(",")):
                rows.append(bench(scenario, B, args.prompt, device, args.steps, args.chunks,
                                  args.out if args.profile else None))
                print(rows[-1], flush=True)
    import platform

    env = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               cpu=platform.processor() or platform.machine(), torch=torch.__version__,
               vllm_relay=os.path.dirname(relay_step.__file__))
    md = markdown(env, rows)
    write_results(args.out, "host", dict(env=env, rows=rows), md)
    print(md)
    return rows


if __name__ == "__main__":
    main()
