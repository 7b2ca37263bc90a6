"""One attention layer of a decode step, as the relay backend runs it (GPU, vllm==0.26.0).

Measures what the relay planner's rule needs and what a layer costs the host:

  rule   For n decode requests of one slot (system prompt of S tokens, own context c), the
         layer's time on the prefix path (each request reads [system pages ; own pages] in one
         FlashAttention call) and on the shared path (own pages with LSE + one grouped call over
         the system pages + relay_fusion), both planned by the real RelayPlanner. Timed inside a
         CUDA graph (as vLLM replays decode steps: the prefix path then also carries the shared
         level's launches with no rows) and eagerly (Python launches, as under piecewise graphs).
         The smallest n from which the shared path is faster is the rule's threshold.
  host   Host time and kernel launches of one eager layer call (torch profiler), for the prefix
         path, the shared path and, with --old-src, the previous implementation (dense system
         store, plan_system_attention) for a before/after table.

Times are medians of triton.testing.do_bench (L2 flushed). Writes <out>/layer.{json,md} (committed under a name with the card's).
Usage: python3 benchmarks/bench_layer.py [--quick] [--old-src DIR] [--out DIR]
"""

import argparse
import json
import os
import sys
import time
from types import SimpleNamespace

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vllm_relay.attention import step as relay_step  # noqa: E402
from vllm_relay.ops.split_schedule import FA3_DYNAMIC_SPLIT_BATCHES  # noqa: E402
from vllm_relay.attention.planner import RelayPlanner  # noqa: E402
from vllm_relay.config import RelayConfig  # noqa: E402
from vllm_relay.ops import RelayPlan, force_one_split, relay_attention  # noqa: E402

# The ops benchmark's FlashAttention entry points and graph capture (same head dim, block, dtype).
from bench_ops import BLOCK, DTYPE, FA, GRAPH_SPLITS, MODELS, capture_graph  # noqa: E402
from bench_ops import HEAD_DIM as D  # noqa: E402

KERNELS = ("triton", "flash")  # the system level: one fused Triton launch, or gather + FA3 + fusion
MAX_MODEL_LEN = 9216


def add_grid_args(p, models=None, ns=None, system_lens=None) -> None:
    """The layer grid's options (comma-separated lists) and --out, for this and the other layer
    benchmarks (layer_kernels.py, tune_level.py)."""
    p.add_argument("--models", default=models, help="model shapes (comma-separated)")
    p.add_argument("--ns", default=ns, help="batch sizes (comma-separated)")
    p.add_argument("--system-lens", default=system_lens, help="system-prompt lengths (comma-separated)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))


def args_():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--old-src", help="a checkout of the previous vllm_relay (for the 'before' host row)")
    p.add_argument("--rep", type=int, default=60)
    add_grid_args(p)  # the rule table's grid (default: all models, and sizes by --quick)
    p.add_argument("--only", choices=["splits", "rule", "host"], help="run one part only")
    p.add_argument("--contexts", default="128", help="own tokens per request in the splits part (comma-separated)")
    p.add_argument("--overlap-only", action="store_true", help="splits part: no static split columns")
    return p.parse_args()


def config(hq, hkv, shared_path, max_seqs, full_graphs=True):
    model = SimpleNamespace(get_num_attention_heads=lambda _p: hq, get_num_kv_heads=lambda _p: hkv, get_head_size=lambda: D, dtype=DTYPE,
                            max_model_len=MAX_MODEL_LEN)
    mode = SimpleNamespace(has_full_cudagraphs=lambda: full_graphs)
    return SimpleNamespace(
        additional_config={"relay": {"max_prompts": 2, "max_prompt_tokens": 8192, "shared_path": shared_path}},
        model_config=model, parallel_config=None,
        scheduler_config=SimpleNamespace(max_num_seqs=max_seqs, max_num_batched_tokens=8192),
        compilation_config=SimpleNamespace(cudagraph_mode=mode, max_cudagraph_capture_size=512))


class Layer:
    """A decode step of n requests on slot 0 (S system tokens), each with c own tokens."""

    def __init__(self, fa, hq, hkv, n, S, c):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        dev = "cuda"
        self.fa, self.hq, self.hkv, self.n, self.S, self.c = fa, hq, hkv, n, S, c
        n_sys, n_own = S // BLOCK, triton.cdiv(c, BLOCK)
        blocks = n_sys + n * n_own + 1
        kv = torch.randn(blocks, BLOCK, hkv, 2 * D, device=dev, dtype=DTYPE)
        self.k_cache, self.v_cache = kv[..., :D], kv[..., D:]
        ids = torch.randperm(blocks - 1, device=dev, dtype=torch.int32) + 1  # block 0: vLLM's null block
        width = triton.cdiv(MAX_MODEL_LEN, BLOCK)
        table = torch.zeros(n, width, dtype=torch.int32, device=dev)
        table[:, :n_own] = ids[n_sys:].view(n, n_own)
        self.q = torch.randn(n, hq, D, device=dev, dtype=DTYPE)
        self.out = torch.empty_like(self.q)
        cfg = RelayConfig(max_prompts=2, max_prompt_tokens=8192)
        relay_step.slot_pages_for(cfg, BLOCK).record(0, ids[:n_sys].tolist())
        cu = torch.arange(n + 1, dtype=torch.int32)
        self.cm = CommonAttentionMetadata(
            query_start_loc=cu.to(dev), query_start_loc_cpu=cu, seq_lens=torch.full((n,), c, dtype=torch.int32,
                                                                                     device=dev),
            num_reqs=n, num_actual_tokens=n, max_query_len=1, max_seq_len=c, block_table_tensor=table,
            slot_mapping=torch.zeros(n, dtype=torch.int64, device=dev))
        import numpy as np

        self.step = relay_step.RelayStep(n, n, np.zeros(n, np.int32), np.full(n, S, np.int32), np.ones(n, np.int32))
        # The same requests without any system prompt (the no-prompt ceiling, and an empty level).
        self.plain_step = relay_step.RelayStep(n, n, np.full(n, -1, np.int32), np.zeros(n, np.int32),
                                               np.ones(n, np.int32))

    def plan(self, shared_path, graph, plain=False, level_splits=None, static=False, fa_split=False, stream=None):
        planner = RelayPlanner(config(self.hq, self.hkv, shared_path, max(self.n, 256), full_graphs=graph),
                               SimpleNamespace(block_size=BLOCK), "cuda")
        step = self.plain_step if plain else self.step
        levels = graph and shared_path != "never"
        if graph:  # as vLLM does: capture (the levels' twin of the graph), then write the step's plan
            with relay_step.capturing(levels):
                planner.plan(self.cm, None, capture=True)
        planner.levels_for(step)
        step.graph_levels = levels if graph else None  # the graph vLLM's dispatcher would replay
        p = planner.plan(self.cm, step)
        run_level = p.run_level or levels  # plain: the levels' graph replayed with no rows
        ctx = p.context
        splits = GRAPH_SPLITS if graph else 0
        context = dict(cu_seqlens_q=ctx.query_start_loc, seqused_k=ctx.seq_lens, max_seqlen_q=1,
                       max_seqlen_k=ctx.max_seq_len, block_table=ctx.block_table_tensor, num_splits=splits,
                       scheduler_metadata=self.fa.schedule(self.n, ctx.query_start_loc, 1, ctx.seq_lens,
                                                           ctx.max_seq_len, True, self.hq, self.hkv, splits))
        level = p.level
        lsplits = splits if level_splits is None else level_splits
        if p.joint and level.call["seqused_k"].shape[0] > FA3_DYNAMIC_SPLIT_BATCHES:
            lsplits = 1  # as the backend runs a joint call of this many sequences
        level.call["num_splits"] = lsplits
        if run_level and not static:  # static: exactly `level_splits` splits, no AOT schedule
            c = level.call
            level.call["scheduler_metadata"] = self.fa.schedule(c["seqused_k"].shape[0], c["cu_seqlens_q"],
                                                                max(c["max_seqlen_q"], 1),
                                                                c["seqused_k"], c["max_seqlen_k"], False, self.hq,
                                                                self.hkv, lsplits)
            if p.one_split and not fa_split:  # as the backend does (rules.graph_one_split)
                force_one_split(level.call["scheduler_metadata"], c["seqused_k"].shape[0])
        return RelayPlan(context, [level] if run_level else [], level_stream=stream), planner

    def call(self, plan):
        return lambda: relay_attention(self.q, self.k_cache, self.v_cache, plan, self.out, D ** -0.5,
                                       self.fa.varlen, {"fa_version": self.fa.version})


def layer_grid(fa, models, system_lens, ns, c=128):
    """(model, S, n, Layer) for each point of the grid, in order. The caller drops its Layer at the
    end of its turn (`del layer`); the cached GPU memory is given back before the next is built."""
    for model in models:
        hq, hkv = MODELS[model]
        for S in system_lens:
            for n in ns:
                yield model, S, n, Layer(fa, hq, hkv, n, S, c)
                torch.cuda.empty_cache()


def write_results(out: str, stem: str, payload: dict, markdown: str) -> None:
    """<out>/<stem>.json and <out>/<stem>.md."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(payload, f, indent=1)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(markdown)


def graph_ms(fn, rep=None):
    """Median ms of `fn` replayed from a CUDA graph (do_bench over `rep` ms, default --rep); NaN,
    reported, when it cannot run (a kernel that does not fit, a failed capture)."""
    try:
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench(capture_graph(fn).replay, warmup=20, rep=rep or ARGS.rep,
                                       return_mode="median")
    except Exception as e:  # noqa: BLE001 - report and go on with the other rows
        print(f"  (graph timing failed: {type(e).__name__}: {str(e)[:200]})", flush=True)
        return float("nan")


def eager_ms(fn):
    return triton.testing.do_bench(fn, warmup=20, rep=ARGS.rep, return_mode="median")


def bench_rule():
    ns = (1, 2, 4, 8, 16, 64) if ARGS.quick else (1, 2, 4, 8, 16, 32, 64, 128)
    Ss = (2048,) if ARGS.quick else (512, 2048, 8192)
    ns = tuple(map(int, ARGS.ns.split(","))) if ARGS.ns else ns
    Ss = tuple(map(int, ARGS.system_lens.split(","))) if ARGS.system_lens else Ss
    models = ARGS.models.split(",") if ARGS.models else list(MODELS)
    rows = []
    for name, S, n, layer in layer_grid(FA(), models, Ss, ns):
        row = dict(model=name, S=S, c=layer.c, n=n)
        # Ceiling: the same requests with no system prompt.
        row["noprompt_graph_us"] = graph_ms(layer.call(layer.plan("never", True, plain=True)[0])) * 1e3
        row["prefix_graph_us"] = graph_ms(layer.call(layer.plan("never", graph=True)[0])) * 1e3
        row["prefix_eager_us"] = eager_ms(layer.call(layer.plan("never", graph=False)[0])) * 1e3
        for kernel in KERNELS:
            os.environ["VLLM_RELAY_LEVEL_KERNEL"] = kernel
            # A captured level with no rows (plain requests), then the shared path.
            row[f"empty_{kernel}_us"] = graph_ms(layer.call(layer.plan("always", True, plain=True)[0])) * 1e3
            row[f"shared_{kernel}_graph_us"] = graph_ms(layer.call(layer.plan("always", graph=True)[0])) * 1e3
            row[f"shared_{kernel}_eager_us"] = eager_ms(layer.call(layer.plan("always", graph=False)[0])) * 1e3
        rows.append(row)
        print(f"{name} S={S:5d} n={n:4d}: " + " ".join(f"{k[:-3]} {v:.1f}" for k, v in row.items()
                                                         if k.endswith("_us")), flush=True)
        del layer
    return rows


def bench_splits():
    """The shared level's FlashAttention call at several split counts (inside a graph): FA3's
    dynamic split (AOT schedule, the count an upper bound; dynamic32 with the planner's one split where
    graph_one_split says so, fa32 FA3's choice alone) and static splits (no AOT schedule). The
    overlap columns run the level on a second stream, concurrent with the context call (the
    backend's level_stream): at high priority (the backend's), at normal priority, and high with
    FA3's own split."""
    from vllm_relay.attention.backend import LEVEL_STREAM_PRIORITY

    os.environ["VLLM_RELAY_LEVEL_KERNEL"] = "flash"
    fa, rows = FA(), []
    high, normal = torch.cuda.Stream(priority=LEVEL_STREAM_PRIORITY), torch.cuda.Stream(priority=0)
    contexts = tuple(map(int, ARGS.contexts.split(",")))
    models = ARGS.models.split(",") if ARGS.models else list(MODELS)
    points = ((2048, 16), (2048, 64), (2048, 256), (8192, 64), (8192, 256))
    if ARGS.ns or ARGS.system_lens:  # the grid's options, when given, choose the points
        points = [(S, n) for S in map(int, (ARGS.system_lens or "2048").split(","))
                  for n in map(int, (ARGS.ns or "256").split(","))]
    for name in models:
        hq, hkv = MODELS[name]
        for (S, n), c in ((p, c) for p in points for c in contexts):
            layer = Layer(fa, hq, hkv, n, S, c)
            row = dict(model=name, S=S, c=c, n=n)
            row["noprompt_us"] = graph_ms(layer.call(layer.plan("never", True, plain=True)[0])) * 1e3
            row["dynamic32_us"] = graph_ms(layer.call(layer.plan("always", True)[0])) * 1e3  # the planner's
            row["fa32_us"] = graph_ms(layer.call(layer.plan("always", True, fa_split=True)[0])) * 1e3  # FA3's split
            row["overlap_us"] = graph_ms(layer.call(layer.plan("always", True, stream=high)[0])) * 1e3
            row["overlap_lo_us"] = graph_ms(layer.call(layer.plan("always", True, stream=normal)[0])) * 1e3
            row["overlap_fa32_us"] = graph_ms(layer.call(layer.plan("always", True, fa_split=True,
                                                                    stream=high)[0])) * 1e3
            for splits in () if ARGS.overlap_only else (1, 2, 4, 8, 16, 32):
                row[f"static_{splits}_us"] = graph_ms(
                    layer.call(layer.plan("always", True, level_splits=splits, static=True)[0])) * 1e3
            rows.append(row)
            print(f"{name} S={S} c={c} n={n}: " + " ".join(f"{k}={v:.1f}" for k, v in row.items()
                                                             if k.endswith("_us")), flush=True)
            del layer
            torch.cuda.empty_cache()
    return rows


def thresholds(rows):
    """Per (model, S, c) and level kernel: the smallest n from which the shared path stays faster
    than the prefix path, inside a graph and eagerly."""
    out = {}
    for r in rows:
        for kernel in KERNELS:
            key = (r["model"], r["S"], r["c"], kernel)
            t = out.setdefault(key, {"graph": None, "eager": None})
            for mode in ("graph", "eager"):
                faster = r[f"shared_{kernel}_{mode}_us"] < r[f"prefix_{mode}_us"]
                if faster and t[mode] is None:
                    t[mode] = r["n"]
                elif not faster:
                    t[mode] = None  # must stay faster for every larger n
    return out


def host_profile():
    """Host time (issue only, no sync) and CUDA launches of one eager layer call."""
    from torch.profiler import ProfilerActivity, profile

    fa, rows = FA(), []
    hq, hkv = MODELS["llama2-7b"]
    layer = Layer(fa, hq, hkv, 64, 2048, 128)
    os.environ["VLLM_RELAY_LEVEL_KERNEL"] = "flash"
    calls = {"prefix path (1 FA call)": layer.call(layer.plan("never", graph=False)[0]),
             "shared path (FA + FA + fusion)": layer.call(layer.plan("always", graph=False)[0])}
    os.environ["VLLM_RELAY_LEVEL_KERNEL"] = "triton"
    calls["shared path (FA + fused Triton level)"] = layer.call(layer.plan("always", graph=False)[0])
    if ARGS.old_src:
        calls["before: dense store (previous implementation)"] = old_call(fa, layer)
    import cProfile
    import io
    import pstats

    fn = calls["shared path (FA + FA + fusion)"]
    prof_c = cProfile.Profile()
    prof_c.enable()
    for _ in range(200):
        fn()
    prof_c.disable()
    text = io.StringIO()
    pstats.Stats(prof_c, stream=text).sort_stats("tottime").print_stats(18)
    os.makedirs(ARGS.out, exist_ok=True)
    with open(os.path.join(ARGS.out, "layer_host_profile.txt"), "w") as f:
        f.write(text.getvalue())
    print("\n".join(text.getvalue().splitlines()[:40]), flush=True)
    for label, fn in calls.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host_us = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA") / 10
        gpu_us = eager_ms(fn) * 1e3
        rows.append(dict(path=label, host_us=host_us, launches=kernels, eager_us=gpu_us))
        print(f"{label}: host {host_us:.1f} us/layer, {kernels:.1f} kernels/layer, eager {gpu_us:.1f} us",
              flush=True)
    return rows


def old_call(fa, layer):
    """The previous implementation on the same layer: dense per-slot system buffers."""
    sys.path.insert(0, ARGS.old_src)
    for mod in [m for m in sys.modules if m.startswith("vllm_relay")]:
        sys.modules[f"_new_{mod}"] = sys.modules.pop(mod)
    import vllm_relay.ops as old_ops

    n, S, c = layer.n, layer.S, layer.c
    sys_pages = layer.cm.block_table_tensor  # own tables; the system part comes from a dense buffer
    k_sys = torch.randn(1, S, layer.hkv, D, device="cuda", dtype=DTYPE)
    v_sys = torch.randn_like(k_sys)
    sys_plan = old_ops.plan_system_attention([0] * n, [S], S, 256, "cuda")
    plan = old_ops.RelayPlan(cu_seqlens_q=layer.cm.query_start_loc, seqused_k=layer.cm.seq_lens, max_seqlen_q=1,
                             max_seqlen_k=c, block_table=sys_pages, system=sys_plan)
    sys.path.remove(ARGS.old_src)
    for mod in [m for m in sys.modules if m.startswith("vllm_relay")]:
        del sys.modules[mod]
    for mod in [m for m in sys.modules if m.startswith("_new_vllm_relay")]:
        sys.modules[mod[len("_new_"):]] = sys.modules.pop(mod)
    return lambda: old_ops.relay_attention(layer.q, layer.k_cache, layer.v_cache, k_sys, v_sys, plan, layer.out,
                                           D ** -0.5, fa.varlen, {"fa_version": fa.version})


def markdown(env, rule_rows, th, host_rows, split_rows):
    lines = [f"# One attention layer of a decode step: {env['gpu']}", "",
             f"vLLM {env['vllm']} (FA{env['fa']}), bf16, D=128, block 16. n decode requests of one slot "
             "(S system tokens), each with c own tokens. Medians of do_bench, L2 flushed.", "",
             "## Prefix path vs shared path (the planner's rule)", "",
             "| model | S | n | no prompt | empty triton | empty flash | prefix | shared triton | shared flash "
             "| prefix eager | shared triton eager | shared flash eager |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rule_rows:
        lines.append(f"| {r['model']} | {r['S']} | {r['n']} | {r['noprompt_graph_us']:.1f} | "
                     f"{r['empty_triton_us']:.1f} | {r['empty_flash_us']:.1f} | {r['prefix_graph_us']:.1f} | "
                     f"{r['shared_triton_graph_us']:.1f} | {r['shared_flash_graph_us']:.1f} | "
                     f"{r['prefix_eager_us']:.1f} | {r['shared_triton_eager_us']:.1f} | "
                     f"{r['shared_flash_eager_us']:.1f} |")
    lines += ["", "Graph columns are CUDA-graph replays (decode steps), eager ones Python launches (piecewise "
              "steps), all us per layer, c=128 own tokens. 'no prompt': the same requests with no system prompt "
              "(the ceiling); 'empty': plain requests in a graph that holds the level (what it costs them); "
              "'prefix': each request reads [system ; own] pages in one FlashAttention call."]
    lines += ["", "Smallest n from which the shared path stays faster than the prefix path:", "",
              "| model | S | level kernel | graph | eager |", "|---|---|---|---|---|"]
    for (model, S, _c, kernel), t in th.items():
        lines.append(f"| {model} | {S} | {kernel} | {t['graph']} | {t['eager']} |")
    lines += ["", "## Host cost of one eager layer (Llama-2-7B shape, n=64, S=2048, c=128)", "",
              "| path | host us / layer | CUDA kernels / layer | eager us |", "|---|---|---|---|"]
    for r in host_rows:
        lines.append(f"| {r['path']} | {r['host_us']:.1f} | {r['launches']:.1f} | {r['eager_us']:.1f} |")
    if split_rows:
        keys = [k for k in split_rows[0] if k.endswith("_us")]
        lines += ["", "## The shared level's split count and stream (whole layer, graph us)", "",
                  "| model | S | c | n | " + " | ".join(k[:-3] for k in keys) + " |",
                  "|---|---|---|---|" + "---|" * len(keys)]
        for r in split_rows:
            lines.append(f"| {r['model']} | {r['S']} | {r['c']} | {r['n']} | "
                         + " | ".join(f"{r[k]:.1f}" for k in keys) + " |")
    lines += ["", "Inside a full CUDA graph (decode steps) a layer costs no host time: the step's plan is "
              "written once (one host-to-device copy and one block-table kernel) and the graph replayed."]
    return "\n".join(lines) + "\n"


def main():
    import vllm

    start = time.time()
    torch.manual_seed(0)
    env = dict(gpu=torch.cuda.get_device_name(), vllm=vllm.__version__, fa=FA().version, quick=ARGS.quick)
    only = ARGS.only
    host_rows = host_profile() if only in (None, "host") else []
    split_rows = bench_splits() if (only == "splits" or (only is None and not ARGS.quick)) else []
    rule_rows = bench_rule() if only in (None, "rule") else []
    th = thresholds(rule_rows)
    env["seconds"] = time.time() - start
    md = markdown(env, rule_rows, th, host_rows, split_rows)
    write_results(ARGS.out, "layer", dict(env=env, rule=rule_rows, thresholds={"|".join(map(str, k)): v
                                                                                    for k, v in th.items()},
                                               host=host_rows, splits=split_rows), md)
    print(md)


if __name__ == "__main__":
    ARGS = args_()
    main()
