"""RelayAttention end to end on CUDA (FlashAttention 3), on the tiny models with real random weights.

bf16 cannot be bit-exact across attention implementations, so the yardstick is another of vLLM's own
backends: relay may differ from FLASH_ATTN by at most twice what TRITON_ATTN does (the flash-attn
tests' rule), on the same mixed workload as the CPU exactness test, and relay must have fired. Where
a request's greedy tokens part from FLASH_ATTN's, the first differing token must be a near-tie of
FLASH_ATTN's own (`tie_margin`), or at most twice as far from one as TRITON_ATTN's parting token is;
how many requests part is printed, not asserted (chance, at 17).
Relay runs twice with every decode token on the shared path (the measured rule would send this small
workload's GQA decodes to the prefix path, and its graphs would then hold no level): with vLLM's
default CUDA graphs (decode steps replay a full graph holding the level) and eagerly; the two must
agree by the same rule.
The same rules at tensor parallelism 2 and 4 (each rank holds its KV heads of the system prompts'
pages; at 4 the GQA model's 2 KV heads are replicated) and data parallelism 2 (independent engine
cores behind an AsyncLLM; counters summed), every engine at the same parallelism; those cases skip
with fewer GPUs visible.
"""

import json
import math
from pathlib import Path

import pytest

from tests.e2e.engine_runner import relay_compiles_after_warm_up, run_engine
from tests.e2e.test_relay_exactness import drafter_setup, workload
from vllm_relay.testing.models import VL_ENGINE, VL_MODELS, get_model

pytestmark = [pytest.mark.gpu, pytest.mark.engine]


def top5(step: dict) -> set:
    """The five most likely tokens of one position's logprobs (all of them: the whole vocabulary where
    the tie rule asks for it)."""
    return set(sorted(step, key=step.get)[-5:])


def divergence(got: list, want: list) -> tuple[float, float]:
    """(fraction of requests with identical greedy tokens, worst logprob difference over the tokens in
    both engines' top 5, at the positions up to each request's first differing token)."""
    same, worst = 0, 0.0
    for g, w in zip(got, want, strict=True):
        same += g["tokens"] == w["tokens"]
        for gt, wt, gs, ws in zip(g["tokens"], w["tokens"], g["logprobs"], w["logprobs"]):
            worst = max([worst] + [abs(gs[k] - ws[k]) for k in top5(gs) & top5(ws)])
            if gt != wt:
                break
    return same / len(got), worst


# Logprobs a request's outputs carry where the tie rule is asked (the features' tests): the whole
# vocabulary (-1; the engines need max_logprobs -1). A random tiny model's logits are nearly flat, so
# within bf16 noise another engine's token can rank far down FLASH_ATTN's list, and `tie_margin` can
# measure a gap only where the token is listed: features-fullgraphs on an H100 gave inf with the top 5
# and with the top 20, for relay and for TRITON_ATTN alike.
TIE_LOGPROBS = {"spec": {"logprobs": -1}, "engine": {"max_logprobs": -1}}


def tie_margin(got: list, want: list) -> float:
    """The largest gap, in `want`'s own logprobs, between its token and `got`'s at each request's first
    differing token (inf when `got`'s is not among `want`'s logprobs). Two engines within bf16 noise of
    each other part ways only on near-ties; how many requests do so on a few dozen is chance."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        for gt, wt, ws in zip(g["tokens"], w["tokens"], w["logprobs"]):
            if gt != wt:
                worst = max(worst, ws[str(wt)] - ws.get(str(gt), float("-inf")))
                break
    return worst


def logprob_bound(ref_err: float) -> float:
    """The most relay's logprobs may differ from FLASH_ATTN's (`divergence`): twice what vLLM's own
    TRITON_ATTN differs by, plus 1e-3."""
    return 2 * ref_err + 1e-3


def tie_bound(ref_err: float, ref_margin: float = 0.0) -> float:
    """The most `tie_margin` may be: each logprob within e = `logprob_bound` of FLASH_ATTN's, the tokens
    can part only where FLASH_ATTN's own gap is at most 2e; or, where vLLM's own TRITON_ATTN parts from
    FLASH_ATTN at a wider gap (`ref_margin`, its `tie_margin`: where the two engines' top 5 do not
    overlap at the parting token, `divergence` does not see it), twice that gap, as the logprobs' rule
    allows twice TRITON_ATTN's difference. An unmeasured `ref_margin` (inf: the token was not listed)
    widens nothing."""
    return max(2 * logprob_bound(ref_err), 2 * ref_margin if math.isfinite(ref_margin) else 0.0)


PARALLEL = {"tp1": {}, "tp2": {"tensor_parallel_size": 2}, "tp4": {"tensor_parallel_size": 4},
            "dp2": {"data_parallel_size": 2}}


def run_four(spec: dict, base: dict, relay_config: dict, tmp_path,
             backends: tuple = ("FLASH_ATTN", "TRITON_ATTN")) -> tuple[dict, str]:
    """The same requests on relay with vLLM's default CUDA graphs, relay eager, and vLLM's FLASH_ATTN and
    TRITON_ATTN with graphs (`backends`: an MLA model's FLASH_ATTN_MLA and TRITON_MLA): ({"relay", "eager",
    "flash", "triton"}: outputs, relay's log). Relay with graphs compiles none of its kernels after the
    engine's warm-up: its capture and warm-up compiled every variant its steps launch."""
    graphs = {"enforce_eager": False, "jit_monitor_verbose": True}
    relay = {"attention_backend": "relay", "additional_config": relay_config}
    engines = {"relay": {**base, **graphs, **relay}, "eager": {**base, **relay},
               "flash": {**base, **graphs, "attention_backend": backends[0]},
               "triton": {**base, **graphs, "attention_backend": backends[1]}}
    runs, log = {}, ""
    for name, engine in engines.items():
        runs[name], out = run_engine({**spec, "engine": engine}, tmp_path, name)
        log = log or out
    compiled = relay_compiles_after_warm_up(log)
    assert not compiled, "\n".join(compiled)
    return runs, log


@pytest.mark.parametrize("parallel", list(PARALLEL))
@pytest.mark.parametrize("name", ["tiny-llama-mha", "tiny-llama-gqa"])
def test_relay_matches_flash_attention_on_cuda(name, parallel, tmp_path):
    import torch

    gpus = max(PARALLEL[parallel].values(), default=1)
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"{parallel} needs {gpus} GPUs, {torch.cuda.device_count()} visible")
    model = get_model(name)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    systems, prompts, num_relay = workload(vocab, seed=3)
    base = {"model": model, "dtype": "bfloat16", "max_model_len": 512, "max_num_batched_tokens": 64,
            **PARALLEL[parallel]}
    relay_config = {"relay": {"system_prompts": systems, "max_prompts": 2, "max_prompt_tokens": 256,
                              "shared_path": "always"}}
    runs, log = run_four({"prompts": prompts, "max_tokens": 16}, base, relay_config, tmp_path)
    relay, eager, flash, triton = runs["relay"], runs["eager"], runs["flash"], runs["triton"]
    assert "implementation: cuda-flash-attn-3" in log
    print(name, "relay stats:", relay["relay_stats"])
    assert relay["relay_stats"]["relay_requests"] == num_relay, relay["relay_stats"]  # no sampled_prompts here
    for engine_stats in relay["relay_stats"].get("engines", []):  # DP: every engine core served some
        assert engine_stats["relay_requests"] > 0, relay["relay_stats"]
    relay_same, relay_err = divergence(relay["outputs"], flash["outputs"])
    ref_same, ref_err = divergence(triton["outputs"], flash["outputs"])
    margin, ref_margin = tie_margin(relay["outputs"], flash["outputs"]), tie_margin(triton["outputs"], flash["outputs"])
    print(f"{name} {parallel}: relay vs FA: {relay_same:.0%} identical, max diff {relay_err:.3g}, tie margin "
          f"{margin:.3g}; TRITON vs FA: {ref_same:.0%}, {ref_err:.3g}, {ref_margin:.3g}")
    assert relay_err <= logprob_bound(ref_err), (relay_err, ref_err)
    assert margin <= tie_bound(ref_err, ref_margin), (margin, ref_err, ref_margin)
    # Graph replay against eager execution of the relay path.
    graph_stats, eager_stats = relay["worker_stats"], eager["worker_stats"]
    print(name, "worker stats: graphs", graph_stats, "eager", eager_stats)
    assert graph_stats["graph_steps"] > 0 and graph_stats["shared_tokens"] > 0, graph_stats
    assert eager_stats["graph_steps"] == 0 and eager_stats["shared_tokens"] > 0, eager_stats
    replay_same, replay_err = divergence(relay["outputs"], eager["outputs"])
    print(f"{name}: relay graphs vs relay eager: {replay_same:.0%} identical, max diff {replay_err:.3g}")
    assert replay_err <= logprob_bound(ref_err), (replay_err, ref_err)


# Attention features the relay split carries exactly (docs/architecture.md): each with its model, the
# same feature on in every engine (FLASH_ATTN's and TRITON_ATTN's too).
FEATURES = {"softcap": ("tiny-gemma2-softcap", {}), "sinks": ("tiny-granite-sinks", {}),
            "fp8": ("tiny-llama-gqa", {"kv_cache_dtype": "fp8"}),
            "window": ("tiny-gemma2-window", {}),  # sliding-window and full layers: two KV-cache groups
            "gptoss": ("tiny-granite-window-sinks", {}),  # gpt-oss's attention: sinks, windows in every other layer
            "mrope": ("tiny-qwen2.5-vl", VL_ENGINE),  # text prompts: positions (p, p, p) in three sections
            # full graphs for every batch, prompt chunks too (hooks/graphs.py): decodes replay the twins
            "fullgraphs": ("tiny-llama-gqa", {"compilation_config": {"cudagraph_mode": "FULL"}})}


def run_with_feature(label: str, name: str, extra: dict, seed: int, max_tokens: int, tmp_path) -> dict:
    """The four engines with a feature on (`extra`, in every engine) over registered prompts: relay
    within the rule against FLASH_ATTN with full CUDA graphs and eagerly. Returns the runs."""
    model = get_model(name)
    systems, prompts, num_relay = workload(3072, seed=seed)  # the tokenizer's words, not Qwen-VL's vision ids
    base = {"model": model, "dtype": "bfloat16", "max_model_len": 512, "max_num_batched_tokens": 64,
            **TIE_LOGPROBS["engine"], **extra}
    relay_config = {"relay": {"system_prompts": systems, "max_prompts": 2, "max_prompt_tokens": 256,
                              "shared_path": "always"}}
    spec = {"prompts": prompts, "max_tokens": max_tokens, **TIE_LOGPROBS["spec"],
            **({"vl": True} if name in VL_MODELS else {})}
    runs, _ = run_four(spec, base, relay_config, tmp_path)
    assert runs["relay"]["relay_stats"]["relay_requests"] == num_relay, runs["relay"]["relay_stats"]
    if label == "fullgraphs":  # which engines part with full graphs of every batch: FLASH_ATTN eager too
        runs["flash-eager"], _ = run_engine({**spec, "engine": {**base, "attention_backend": "FLASH_ATTN"}},
                                            tmp_path, "flash-eager")
        print_pairs(label, runs)
    assert_graphs_and_eager_within_rule(label, runs)
    return runs


def print_pairs(label: str, runs: dict) -> None:
    """Every two engines: how many requests' tokens are identical, `divergence`'s logprob difference and
    `tie_margin`, each against the second engine's logprobs."""
    for want in runs:
        cells = [f"{got} {same:.0%} {err:.3g} {tie_margin(runs[got]['outputs'], runs[want]['outputs']):.3g}"
                 for got in runs if got != want
                 for same, err in [divergence(runs[got]["outputs"], runs[want]["outputs"])]]
        print(f"{label} against {want} (identical, max diff, tie margin): " + "; ".join(cells))


def assert_graphs_and_eager_within_rule(label: str, runs: dict) -> None:
    """`run_four`'s relay runs, with graphs and eagerly, each within the rule against FLASH_ATTN (so
    within twice it of each other), and relay's greedy tokens parting only at near-ties."""
    relay, eager, flash, triton = runs["relay"], runs["eager"], runs["flash"], runs["triton"]
    relay_same, relay_err = divergence(relay["outputs"], flash["outputs"])
    ref_same, ref_err = divergence(triton["outputs"], flash["outputs"])
    eager_same, eager_err = divergence(eager["outputs"], flash["outputs"])
    replay_same, replay_err = divergence(relay["outputs"], eager["outputs"])
    print(f"{label}: relay vs FA: {relay_same:.0%} identical, max diff {relay_err:.3g}; relay eager vs FA: "
          f"{eager_same:.0%}, {eager_err:.3g}; TRITON vs FA: {ref_same:.0%}, {ref_err:.3g}; relay graphs vs "
          f"eager: {replay_same:.0%}, {replay_err:.3g}")
    bound = logprob_bound(ref_err)
    assert relay_err <= bound and eager_err <= bound and replay_err <= 2 * bound, (relay_err, eager_err,
                                                                                  replay_err, ref_err)
    margin = tie_margin(relay["outputs"], flash["outputs"])
    ref_margin = tie_margin(triton["outputs"], flash["outputs"])
    limit = tie_bound(ref_err, ref_margin)
    print(f"{label}: tie margin {margin:.3g} (TRITON's {ref_margin:.3g}; bound {limit:.3g})")
    assert margin <= limit, (margin, ref_margin, ref_err)


def image_prompts(model: str) -> list[dict]:
    """Samples of prompts that begin with an image (Qwen2.5-VL's vision tokens, 224 x 224 pixels: 64
    image tokens) and 96 words: two images with the same words, six questions each, and two text
    prompts with those words alone. vLLM's prefix cache shares an image's blocks only among the prompts
    of that image (its hash is in theirs)."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    start, pad, end = tok.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    rng = random.Random(9)

    def words(n):
        return [rng.randrange(8, 3072) for _ in range(n)]

    shared = words(96)
    prompts = [{"ids": [start, pad, end, *shared, *words(rng.randrange(12, 40))], "image": [224, 224, seed]}
               for seed in (1, 2) for _ in range(6)]
    return prompts + [{"ids": shared + words(20)} for _ in range(2)]


def test_features_images_in_shared_prompts_on_cuda_against_flash(tmp_path):
    """M-RoPE with images: the samples of an image's prompts share its blocks (vLLM's prefix cache, the
    image's hash in the block hashes), relay reads them as levels it found in the block tables (no
    position shift: the cache holds the keys as vLLM placed them), and two images under the same words
    never share. Relay within the rule against FLASH_ATTN, with full CUDA graphs and eagerly."""
    model = get_model("tiny-qwen2.5-vl")
    base = {"model": model, "dtype": "bfloat16", "max_model_len": 512, "max_num_batched_tokens": 256,
            "limit_mm_per_prompt": {"image": 1, "video": 0}}
    spec = {"prompts": image_prompts(model), "max_tokens": 16, "vl": True}
    runs, _ = run_four(spec, base, {"relay": {"shared_path": "always"}}, tmp_path)
    assert_graphs_and_eager_within_rule("images", runs)
    stats = runs["relay"]["worker_stats"]
    print("images: worker stats", stats)
    assert stats["shared_tokens"] > 0 and stats["level_groups"] > 0, stats


@pytest.mark.parametrize("feature", list(FEATURES))
def test_features_on_cuda_against_flash(feature, tmp_path):
    """Soft-capping, sinks, an FP8 KV cache, sliding windows (in every other layer: those read each level
    from each row's window on, through ops/window_level.py's kernel), sinks with windows (gpt-oss's
    attention), M-RoPE (text prompts) and `cudagraph_mode=FULL`: relay within the rule above against
    FLASH_ATTN with the feature on, with full CUDA graphs and eagerly."""
    name, extra = FEATURES[feature]
    stats = run_with_feature(feature, name, extra, 3, 16, tmp_path)["relay"]["worker_stats"]
    assert stats["level_graph_steps"] > 0 and stats["shared_tokens"] > 0, stats
    if feature in ("window", "gptoss"):  # the window layers read the levels too: no request on the prefix path
        assert stats["prefix_requests"] == 0, stats
    if feature == "fullgraphs":  # prompt chunks replayed vLLM's graphs, no levels in them
        assert stats["graph_steps"] > stats["level_graph_steps"], stats


def test_features_mla_on_cuda_against_flash_attn_mla(tmp_path):
    """DeepSeek-V2's latent attention (`tiny-deepseek-v2`: 16 heads, a 512 + 64 latent) on relay's MLA backend
    (attention/mla_backend.py): within the rule against vLLM's FLASH_ATTN_MLA (TRITON_MLA
    the yardstick), with full CUDA graphs and eagerly; the decodes and short prompt chunks read their levels
    in the latent space, a prompt chunk of more than 512 tokens runs vLLM's MHA form over its context
    table (its registered prompt's pages in front)."""
    import random

    systems, prompts, num_relay = workload(3072, seed=5)
    rng = random.Random(5)
    prompts.append(systems["a"] + [rng.randrange(8, 3072) for _ in range(600)])  # one chunk of 700 tokens
    num_relay += 1
    base = {"model": get_model("tiny-deepseek-v2"), "dtype": "bfloat16", "max_model_len": 1024,
            "max_num_batched_tokens": 1024, **TIE_LOGPROBS["engine"]}
    relay_config = {"relay": {"system_prompts": systems, "max_prompts": 2, "max_prompt_tokens": 256,
                              "shared_path": "always"}}
    spec = {"prompts": prompts, "max_tokens": 16, **TIE_LOGPROBS["spec"]}
    runs, log = run_four(spec, base, relay_config, tmp_path, backends=("FLASH_ATTN_MLA", "TRITON_MLA"))
    assert "implementation: cuda-flash-attn-3-mla" in log
    assert runs["relay"]["relay_stats"]["relay_requests"] == num_relay, runs["relay"]["relay_stats"]
    assert_graphs_and_eager_within_rule("mla", runs)
    graph_stats, eager_stats = runs["relay"]["worker_stats"], runs["eager"]["worker_stats"]
    print("mla: worker stats: graphs", graph_stats, "eager", eager_stats)
    assert graph_stats["level_graph_steps"] > 0 and graph_stats["shared_tokens"] > 0, graph_stats
    assert eager_stats["shared_tokens"] > 0 and eager_stats["prefix_requests"] > 0, eager_stats


def test_ngram_speculative_decoding_on_cuda_against_flash(tmp_path, monkeypatch):
    """n-gram drafts (no drafter model) on Model Runner V2: verification steps of several tokens per
    request read the levels as prompt chunks do, in full graphs too (their levels' twins, captured as
    such steps, VLLM_RELAY_VERIFY_GRAPHS=1; vLLM's graphs by default, as every decode step without
    levels replays); relay within the rule against FLASH_ATTN with the same drafter, graphs and eager,
    and drafts accepted under relay as without it."""
    monkeypatch.setenv("VLLM_RELAY_VERIFY_GRAPHS", "1")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    runs = run_with_feature("ngram", "tiny-llama-loops", {"speculative_config": spec}, 7, 48, tmp_path)
    relay, flash = runs["relay"], runs["flash"]
    print(f"ngram drafts {relay['draft_tokens']}, accepted {relay['accepted_tokens']} (FLASH_ATTN: "
          f"{flash['draft_tokens']}, {flash['accepted_tokens']})")
    assert relay["worker_stats"]["shared_tokens"] > 0, relay["worker_stats"]
    assert relay["worker_stats"]["level_graph_steps"] > 0, relay["worker_stats"]  # verifications replayed
    assert relay["draft_tokens"] > 200 and relay["accepted_tokens"] > relay["draft_tokens"] // 3, relay


def draft_divergence(got: list, want: list) -> list[float]:
    """Per draft position (the first pass, then each later one), the fraction of the steps both engines
    drafted for a request, up to its first differing draft list, whose token there differs."""
    differ, total = None, 0
    for g, w in zip(got, want, strict=True):
        for gs, ws in zip(g, w):
            differ = differ or [0] * len(gs)
            total += 1
            for k, (x, y) in enumerate(zip(gs, ws)):
                differ[k] += x != y
            if gs != ws:
                break
    return [d / max(total, 1) for d in differ or [0]]


@pytest.mark.parametrize("method,tokens", [("eagle3", 1), ("eagle3", 3), ("mtp", 1)])
def test_drafter_models_on_cuda_against_flash(method, tokens, tmp_path, monkeypatch):
    """Drafter models on Model Runner V2 (hooks/drafter.py): EAGLE-3, one and three tokens a step, and
    MiMo's MTP layer (one: vLLM's MiMo drafts one); verification steps and the drafter's first pass replay
    the levels' twins (hooks/graphs.py). Relay's greedy outputs within the rule against
    FLASH_ATTN with the same drafter, graphs and eager, and its drafts too, position by position, against
    FLASH_ATTN's in the same mode (graphs, eager): relay's drafts may part from them in at most twice the
    share of steps TRITON_ATTN's part from FLASH_ATTN's with graphs, plus
    2% (near-ties of a random head in bf16); a drafter reading the wrong pages, or placing its KV by
    shifted positions, parts in most steps. No prompt chunked (vLLM's own drafts differ between a
    chunked and a whole prefill)."""
    monkeypatch.setenv("VLLM_RELAY_VERIFY_GRAPHS", "1")  # the twins (vLLM's graphs by default)
    model, spec, (systems, prompts, num_relay) = drafter_setup(method, tokens)
    base = {"model": model, "dtype": "bfloat16", "max_model_len": 512, "max_num_batched_tokens": 2048,
            "max_num_seqs": 16, "speculative_config": spec}
    relay_config = {"relay": {"system_prompts": systems, "max_prompts": 2, "max_prompt_tokens": 256,
                              "shared_path": "always"}}
    requests = {"prompts": prompts, "max_tokens": 24, "drafts": True}
    runs, _ = run_four(requests, base, relay_config, tmp_path)
    # Eager code rounds differently from compiled code (no fused norms and rotary): a random draft head,
    # whose logits are nearly flat, flips on that alone, so relay eager's drafts go against FLASH_ATTN
    # eager's (its outputs against FLASH_ATTN with graphs, as every run's).
    runs["flash-eager"], _ = run_engine({**requests, "engine": {**base, "attention_backend": "FLASH_ATTN"}},
                                        tmp_path, "flash-eager")
    relay, eager, flash, triton = runs["relay"], runs["eager"], runs["flash"], runs["triton"]
    assert relay["relay_stats"]["relay_requests"] == num_relay, relay["relay_stats"]
    # Verification steps replayed the levels' twins (and the drafter's first pass its own).
    assert relay["worker_stats"]["level_graph_steps"] > 0, relay["worker_stats"]
    assert all(len(d) >= 8 for d in flash["drafts"]), [len(d) for d in flash["drafts"]]
    ref_same, ref_err = divergence(triton["outputs"], flash["outputs"])
    bound = logprob_bound(ref_err)
    ref_drafts = draft_divergence(triton["drafts"], flash["drafts"])
    print(f"{method} x{tokens} FA eager vs FA graphs: drafts differ "
          f"{draft_divergence(runs['flash-eager']['drafts'], flash['drafts'])}")
    for name, run, want in (("graphs", relay, flash), ("eager", eager, runs["flash-eager"])):
        same, err = divergence(run["outputs"], flash["outputs"])
        drafts = draft_divergence(run["drafts"], want["drafts"])
        print(f"{method} x{tokens} relay {name} vs FA: {same:.0%} identical, max diff {err:.3g}, drafts differ "
              f"{drafts} (against FA {name}); TRITON vs FA: {ref_same:.0%}, {ref_err:.3g}, drafts differ "
              f"{ref_drafts}; accepted {run['accepted_tokens']} of {run['draft_tokens']} (FA {name}: "
              f"{want['accepted_tokens']} of {want['draft_tokens']})")
        margin = tie_margin(run["outputs"], flash["outputs"])
        assert err <= bound and margin <= tie_bound(ref_err), (err, margin, ref_err)
        assert all(d <= 2 * r + 0.02 for d, r in zip(drafts, ref_drafts, strict=True)), (drafts, ref_drafts)


@pytest.mark.parametrize("name", ["tiny-llama-mha", "tiny-llama-gqa", "tiny-granite-sinks"])
def test_unsplit_joint_graphs_match_eager_on_cuda(name, tmp_path, monkeypatch):
    """VLLM_RELAY_UNSPLIT_GRAPHS=2: every decode size has a twin with its levels' call captured unsplit
    (no split workspace, no combine), replayed on every step with levels: the joint call, and the
    levels' own call beside the context's (sinks: no joint call). Its replays hold to the same rules
    against FLASH_ATTN and relay's eager run (the knob changes graph steps only)."""
    monkeypatch.setenv("VLLM_RELAY_UNSPLIT_GRAPHS", "2")
    model = get_model(name)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    systems, prompts, _ = workload(vocab, seed=5)
    base = {"model": model, "dtype": "bfloat16", "max_model_len": 512, "max_num_batched_tokens": 64}
    relay_config = {"relay": {"system_prompts": systems, "max_prompts": 2, "max_prompt_tokens": 256,
                              "shared_path": "always"}}
    runs, _ = run_four({"prompts": prompts, "max_tokens": 16}, base, relay_config, tmp_path)
    stats = runs["relay"]["worker_stats"]
    print(name, "unsplit worker stats:", stats)
    assert stats["level_graph_steps"] > 0 and (stats["joint_steps"] > 0) == ("sinks" not in name), stats
    assert stats["unsplit_graph_steps"] == stats["level_graph_steps"], stats
    _, ref_err = divergence(runs["triton"]["outputs"], runs["flash"]["outputs"])
    relay_same, relay_err = divergence(runs["relay"]["outputs"], runs["flash"]["outputs"])
    replay_same, replay_err = divergence(runs["relay"]["outputs"], runs["eager"]["outputs"])
    print(f"{name}: unsplit graphs vs FA: {relay_same:.0%} identical, max diff {relay_err:.3g}; "
          f"vs relay eager: {replay_same:.0%}, {replay_err:.3g}; TRITON vs FA {ref_err:.3g}")
    bound = logprob_bound(ref_err)
    assert relay_err <= bound and replay_err <= bound, (relay_err, replay_err, ref_err)
    assert tie_margin(runs["relay"]["outputs"], runs["flash"]["outputs"]) <= tie_bound(ref_err)


def test_shared_levels_match_flash_attention_on_cuda(tmp_path):
    """Levels found in the block tables (a registered preamble, documents under it, the same prompt
    several times, seeded samples of questions: up to three levels per token) on CUDA: relay within
    the rule above against FLASH_ATTN on the greedy requests, with full CUDA graphs (steps with levels
    replay the levels' twin of each graph, the others vLLM's own) and eagerly."""
    from tests.e2e.test_auto_levels import workload as levels_workload

    model = get_model("tiny-llama-mha")
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    spec = levels_workload(vocab, seed=3)
    base = {"model": model, "dtype": "bfloat16", "max_model_len": 512, "max_num_seqs": 32}
    relay_config = {"relay": {"system_prompts": {"preamble": spec["preamble"]}, "max_prompt_tokens": 256,
                              "shared_path": "always"}}
    run = {"prompts": spec["prompts"], "max_tokens": 16, "samples": spec["samples"]}
    runs, _ = run_four(run, base, relay_config, tmp_path)
    relay, eager, flash, triton = runs["relay"], runs["eager"], runs["flash"], runs["triton"]
    relay_same, relay_err = divergence(relay["outputs"], flash["outputs"])
    ref_same, ref_err = divergence(triton["outputs"], flash["outputs"])
    replay_same, replay_err = divergence(relay["outputs"], eager["outputs"])
    print(f"levels: relay vs FA: {relay_same:.0%} identical, max diff {relay_err:.3g}; TRITON vs FA: "
          f"{ref_same:.0%}, {ref_err:.3g}; relay graphs vs eager: {replay_same:.0%}, {replay_err:.3g}")
    print("levels worker stats: graphs", relay["worker_stats"], "eager", eager["worker_stats"])
    bound = logprob_bound(ref_err)
    assert relay_err <= bound and replay_err <= bound, (relay_err, replay_err, ref_err)
    margin = tie_margin(relay["outputs"], flash["outputs"])
    assert margin <= tie_bound(ref_err), (margin, ref_err)
    stats = relay["worker_stats"]
    assert stats["level_graph_steps"] > 0 and all(stats[f"tokens_under_{k}_levels"] > 0 for k in (1, 2, 3)), stats


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up_refill_the_system_prompt(level, tmp_path):
    """Sleep discards the KV cache (and at level 2 the weights, loaded again before waking the KV
    cache): relay fills its prompts again after waking, and answers as FLASH_ATTN does after the
    same sleep, within the GPU rule."""
    model = get_model("tiny-llama-gqa")
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    systems, prompts, num_relay = workload(vocab, seed=5)
    base = {"model": model, "dtype": "bfloat16", "max_model_len": 512, "max_num_batched_tokens": 64,
            "enable_sleep_mode": True, "enforce_eager": False}
    relay_config = {"relay": {"system_prompts": systems, "max_prompts": 2, "max_prompt_tokens": 256}}
    spec = {"prompts": prompts, "max_tokens": 16, "first": {"prompts": prompts, "max_tokens": 16}, "sleep": level}
    relay, _ = run_engine({**spec, "engine": {**base, "attention_backend": "relay",
                                              "additional_config": relay_config}}, tmp_path, "relay")
    flash, _ = run_engine({**spec, "engine": {**base, "attention_backend": "FLASH_ATTN"}}, tmp_path, "flash")
    triton, _ = run_engine({**spec, "engine": {**base, "attention_backend": "TRITON_ATTN"}}, tmp_path, "triton")

    stats = relay["relay_stats"]
    assert stats["relay_requests"] == 2 * num_relay and stats["refills"] >= 1 and stats["fills_failed"] == 0, stats
    for phase in ("before", "after"):
        pick = (lambda r: r["first"]["outputs"]) if phase == "before" else (lambda r: r["outputs"])
        relay_same, relay_err = divergence(pick(relay), pick(flash))
        ref_same, ref_err = divergence(pick(triton), pick(flash))
        print(f"sleep level {level}, {phase}: relay vs FA {relay_same:.0%} identical, max diff {relay_err:.3g}; "
              f"TRITON vs FA {ref_same:.0%}, {ref_err:.3g}")
        assert relay_err <= logprob_bound(ref_err), (phase, relay_err, ref_err)
