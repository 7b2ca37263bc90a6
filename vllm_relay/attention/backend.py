"""The relay backend on CUDA: vLLM's FlashAttention backend, extended.

Subclassing keeps FlashAttention's KV-cache layout, cache writes (`reshape_and_cache_flash`),
AOT scheduling, CUDA-graph support and validation consistent with the vLLM release we pin.
System prompts live in pages of the same paged cache. Each step the builder plans (once) the
levels, runs of pages that several requests read, decode tokens and prompt chunks alike (a system
prompt, what the prefix cache shares below it), each read once for all of them, and the context
tables, each request's pages past its levels (with its slot's pages in front on the prefix path):

* no level: FlashAttention's own forward over the context tables, one call;
* otherwise `ops.relay_attention`: the context call with LSE, one grouped call over every level
  (on a second CUDA stream, concurrent with the context call: `level_stream`), the fusion.

A full-CUDA-graph step large enough for levels captures the second form, over persistent plan
tensors, so one captured graph serves any mix of requests and any tree of sharing.
"""

import torch
from vllm.platforms import current_platform
from vllm.utils.math_utils import round_up
from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends import flash_attn
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import is_quantized_kv_cache

from vllm_relay.attention import step as relay_step
from vllm_relay.attention.common import (
    any_sinks,
    check_engine,
    check_layer,
    layer_impls,
    log_active,
    logger,
    window_of,
)
from vllm_relay.attention.planner import RelayPlanner
from vllm_relay.ops import RelayPlan, force_one_split, graph_split_cap, relay_attention
from vllm_relay.ops.split_schedule import FA3_DYNAMIC_SPLIT_BATCHES
from vllm_relay.ops.window_level import warm_up_window_level, window_level_attention


class RelayAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # the enum member `relay` aliases; see vllm_relay.register

    @staticmethod
    def get_impl_cls() -> type["RelayAttentionImpl"]:
        return RelayAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["RelayMetadataBuilder"]:
        return RelayMetadataBuilder

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True  # window layers read each level from each row's window on (`RelayPlanner.window`)

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


class RelayBuilder:
    """What relay's CUDA metadata builders share (FlashAttention's below, FLASH_ATTN_MLA's in mla_backend.py),
    first in their bases, before vLLM's builder: the relay state beside the planner (`_relay_state`), how a
    step reaches the planner, where FA3's schedule of the levels' call is kept, and the plan the layers
    read. A subclass calls `_relay_state` in its `__init__` and has `_build`."""

    # CUDA-graph support is vLLM's builder's (full graphs with FA3): every tensor the relay path
    # reads is a persistent planner buffer. Cached metadata must never be reused for another
    # group's block table: it holds more than the table.
    supports_update_block_table = False
    # The relay model state hands each step to `build` (attention/model_state.py), and tells the
    # builder whether the graph being captured holds the levels (`capturing`).
    takes_relay_step = True
    # A drafter's builder: the model state whose `draft_step` its passes of a token a row read
    # (hooks/drafter.py); None for the target's builders.
    draft_of = None

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False, relay_step=None):
        return self._build(common_attn_metadata, fast_build, relay_step)

    def build_for_cudagraph_capture(self, common_attn_metadata):
        return self._build(common_attn_metadata, False, None, capture=True)

    def use_cascade_attention(self, *args, **kwargs) -> bool:
        return False  # relay replaces cascade attention; never stack the two

    def _relay_state(self, planner, device, aot_schedule: bool) -> None:
        """The planner, whether the graph being captured holds the levels (the model state sets it), the
        level stream and, with full CUDA graphs and FA3's ahead-of-time schedule, the persistent buffer
        of the levels' call's schedule."""
        self.planner = planner
        self.capturing = (False, False)  # (with the levels, unsplit)
        # vLLM's in-place update of a drafter's metadata between its passes would leave relay's
        # context tables and lengths as they were: vLLM builds each pass's instead.
        self.supports_draft_decode_metadata_update = False
        self.level_stream = level_stream(device)
        self.level_stream_eager = LEVEL_STREAM == "all"
        self.level_scheduler_metadata = None
        if self.use_full_cuda_graph and aot_schedule:
            self.level_scheduler_metadata = torch.zeros(1 + round_up(planner.max_call_seqs, 4) * 4,
                                                        dtype=torch.int32, device=self.device)

    def _vllm_build(self, cm, fast_build: bool):
        """vLLM's builder's metadata for `cm` (the base after this class)."""
        return super().build(0, cm, fast_build)

    def _plan(self, cm, step, capture: bool):
        """The planner's plan of this step (None: vLLM's own metadata is the whole story), the step it
        planned, and whether the graph being captured runs its levels unsplit."""
        draft = step is None and self.draft_of is not None and not capture
        if draft:  # a drafter's pass of one token a row
            step = self.draft_of.draft_step
        step = relay_step.covering(step, cm.num_reqs, cm.num_actual_tokens)
        levels, unsplit = self.capturing if capture else (False, False)
        # A drafter's pass: vLLM picks its graph unseen, so it is planned as a graph step wherever the
        # planner's rule says one runs (a captured graph reads the plan's tables, relay rows or not).
        graph = None if draft else capture or (step is not None and step.graph_levels is not None)
        return self.planner.plan(cm, step, capture=capture, levels=levels, graph=graph), step, unsplit

    def _kept(self, sched):
        """FA3's schedule of the levels' call, copied into the persistent buffer when full CUDA graphs are on."""
        buf = self.level_scheduler_metadata
        if buf is None:
            return sched
        n = sched.shape[0]
        buf[:n] = sched
        buf[n:] = 0  # as FlashAttention does: stale entries could let extra blocks write
        return buf[:n]

    def _use_schedule(self, plan, splits: int, sched) -> None:
        """The levels' call runs with FA3's schedule `sched` (None: none made). The graph's levels unsplit
        this step (rules.graph_one_split), where the schedule has FA3's layout; else FA3's split stands
        (the stat overcounts)."""
        if sched is None:
            return
        call = plan.level.call
        if plan.one_split and splits > 1 and not force_one_split(sched, call["seqused_k"].shape[0]):
            logger.warning_once("vllm-relay: FlashAttention's schedule is not FA3's dynamic-split "
                                "layout: graph levels keep FA3's split (one_split_steps overcounts)")
        call["scheduler_metadata"] = sched

    def _relay_plan(self, plan, context: dict, level) -> RelayPlan:
        """What the layers read: `plan`'s level (`level`: it, or a view of it) after the context call of
        `context`'s keywords, on the level stream in graphs (and eagerly with LEVEL_STREAM "all")."""
        stream = self.level_stream if plan.graph or self.level_stream_eager else None
        return RelayPlan(context=context, shared=[level] if plan.run_level else [], level_stream=stream)


class RelayMetadataBuilder(RelayBuilder, FlashAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.fp8 = is_quantized_kv_cache(vllm_config.cache_config.cache_dtype)
        impls = layer_impls(vllm_config, layer_names)
        # FP8 queries where the layers quantize them (FlashAttention's choice, per its version).
        quantized_q = self.fp8 and any(getattr(impl, "supports_quant_query_input", False) for impl in impls)
        self._relay_state(RelayPlanner(vllm_config, kv_cache_spec, device, num_layers=len(layer_names),
                                       joint=not any_sinks(impls), window=window_of(impls),
                                       level_fn=window_level_attention,
                                       query_dtype=current_platform.fp8_dtype() if quantized_q else None),
                          device, self.aot_schedule)
        if self.planner.window:
            self._warm_up_window_levels(impls[0])
        if self.use_full_cuda_graph and self.aot_schedule:
            # FA3's split workspace in every graph, for the context and the levels' calls alike
            # (vLLM's cap, 32, is 8x what FA3 can use with 32 KV heads on an H100).
            self.max_num_splits = graph_split_cap(self.max_num_splits, self.planner.num_sms, self.num_heads_kv)

    def _warm_up_window_levels(self, impl) -> None:
        """Compile the window level kernel's variants that an eager step's prompt chunks launch
        (`warm_up_window_level`), on a cache of two pages laid out and typed as the layers' (`_caches`; with
        one, its page stride would be canonicalized to another value than theirs)."""
        p = self.planner
        kv = torch.zeros(2, p.hkv, p.page_size, 2 * impl.head_size, device=p.device,
                         dtype=torch.uint8 if impl.fp8_dtype is not None else self.kv_cache_dtype)
        k, v = _caches(kv, impl.head_size, impl.fp8_dtype)
        descale = {}
        if impl.fp8_dtype is not None:  # per-tensor scales on the device, as the layers' (`forward`)
            one = torch.ones(1, dtype=torch.float32, device=p.device)
            descale = dict(k_descale=one, v_descale=one,
                           q_descale=one if p.q_buf.dtype == impl.fp8_dtype else None)
        warm_up_window_level(p.q_buf, k, v, p.out_buf, p.max_tokens, p.window, impl.scale,
                             softcap=impl.logits_soft_cap or 0.0, **descale)

    def _build(self, cm, fast_build: bool, step, capture: bool = False):
        plan, step, unsplit = self._plan(cm, step, capture)
        if plan is None:
            meta = self._vllm_build(cm, fast_build)
            meta.relay = None
            return meta
        meta = self._vllm_build(plan.context, fast_build)  # FlashAttention over the context tables
        level = plan.level
        splits = meta.max_num_splits
        unsplit_graph = plan.graph and (unsplit if capture else step.graph_unsplit)
        if unsplit_graph or (plan.joint and (level.call["seqused_k"].shape[0] > FA3_DYNAMIC_SPLIT_BATCHES
                                             or (plan.one_split and not plan.graph))):
            splits = 1  # (the graph's unsplit twin; or FA3 would split every sequence alike, the tokens' too)
        level.call["num_splits"] = splits
        if (plan.run_level or plan.graph) and not self.planner.window:  # (a window's levels: no FA call)
            self._use_schedule(plan, splits, self._schedule_level(level.call, splits, fast_build))
        context = dict(cu_seqlens_q=meta.query_start_loc, seqused_k=meta.seq_lens,
                       max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len,
                       block_table=meta.block_table, scheduler_metadata=meta.scheduler_metadata,
                       num_splits=meta.max_num_splits)
        meta.relay = self._relay_plan(plan, context, level)
        return meta

    def _schedule_level(self, call: dict, num_splits: int, fast_build: bool):
        """FlashAttention-3's ahead-of-time schedule of the levels' call, as FA's builder makes
        its own (into a persistent buffer when full CUDA graphs are on)."""
        if not self.aot_schedule or fast_build or call["max_seqlen_q"] == 0:
            return None
        sched = flash_attn.get_scheduler_metadata(
            batch_size=call["seqused_k"].shape[0], max_seqlen_q=call["max_seqlen_q"],
            max_seqlen_k=call["max_seqlen_k"], num_heads_q=self.num_heads_q, num_heads_kv=self.num_heads_kv,
            headdim=self.headdim, cache_seqlens=call["seqused_k"],
            qkv_dtype=current_platform.fp8_dtype() if self.fp8 else self.kv_cache_dtype,
            cu_seqlens_q=call["cu_seqlens_q"], page_size=self.block_size, causal=False,
            window_size=(-1, -1), num_splits=num_splits,
        )
        return self._kept(sched)


# Levels on their own stream: a decode step's context call is bound by its reads, a system level by
# its FLOPs, so the two overlap. Priority: the level's few CTAs take SMs as they free up, before the
# context call's many (bench_layer.py --only splits, "overlap" columns; the script is in git history).
LEVEL_STREAM_PRIORITY = -1


# Which steps run their levels on the level stream: full-CUDA-graph steps only ("graphs"); eager
# steps keep them in vLLM's stream ("all" would put every step's there, "off" none). Eager steps on
# the stream allocate from its own pool (the caching allocator retried, freeing and synchronising,
# 1-2 times a run on the H100; never without), and end to end every step on it measured +2.0% and
# -0.7% in two jobs (H100, 2026-11-27: benchmarks/results/archive/2026-11-26_ceiling/README.md, the
# 00:39 run): no gain to keep the extra pool for.
LEVEL_STREAM = "graphs"


def level_stream(device) -> torch.cuda.Stream | None:
    """The stream the levels run on (None with LEVEL_STREAM "off", or off CUDA)."""
    if LEVEL_STREAM == "off" or torch.device(device).type != "cuda":
        return None
    return torch.cuda.Stream(device, priority=LEVEL_STREAM_PRIORITY)


def check_runner() -> None:
    """Relay runs on Model Runner V2 on GPUs (vLLM's default there): refuse the V1 runner with the
    reason, and put the worker hooks in place before vLLM makes the runner's model state (this
    runs as the model's first attention layer is built, in the worker only)."""
    from vllm.config import get_current_vllm_config

    if not get_current_vllm_config().use_v2_model_runner:
        raise NotImplementedError("The relay attention backend runs on vLLM's Model Runner V2 on GPUs: "
                                  "unset VLLM_USE_V2_MODEL_RUNNER (or set it to 1)")
    from vllm_relay.hooks.model_runner import apply_worker

    apply_worker()


class RelayAttentionImpl(FlashAttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                 kv_cache_dtype, logits_soft_cap=None, attn_type=AttentionType.DECODER,
                 kv_sharing_target_layer_name=None, sinks=None) -> None:
        check_layer("CUDA", alibi_slopes=alibi_slopes, attn_type=attn_type,
                    kv_sharing_target_layer_name=kv_sharing_target_layer_name)
        check_engine()
        check_runner()
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window,
                         kv_cache_dtype, logits_soft_cap, attn_type, kv_sharing_target_layer_name,
                         sinks)
        # Soft-capping in every call (0: none), sinks in the context call only (ops/relay_attention.py).
        self.attn_kwargs = {"fa_version": self.vllm_flash_attn_version, "softcap": self.logits_soft_cap}
        self.context_kwargs = {} if self.sinks is None else {"s_aux": self.sinks}
        if tuple(self.sliding_window) != (-1, -1):  # the context call's window (the levels': each row's key start)
            self.context_kwargs["window_size"] = self.sliding_window
        self.fp8_dtype = current_platform.fp8_dtype() if is_quantized_kv_cache(kv_cache_dtype) else None
        log_active(f"cuda-flash-attn-{self.vllm_flash_attn_version} (vllm.vllm_flash_attn)")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        plan = getattr(attn_metadata, "relay", None)
        if plan is None or not plan.shared:  # plain or prefix path: FlashAttention's own call
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by relay")
        n = attn_metadata.num_actual_tokens
        key_cache, value_cache = _caches(kv_cache, self.head_size, self.fp8_dtype)
        descale = None
        if self.fp8_dtype is not None:
            descale = (layer._q_scale if self.supports_quant_query_input else None, layer._k_scale, layer._v_scale)
        relay_attention(query[:n], key_cache, value_cache, plan, output[:n], self.scale,
                        flash_attn.flash_attn_varlen_func, self.attn_kwargs, self.context_kwargs, descale)
        return output


def _caches(kv_cache, head_size: int, fp8_dtype):
    """A layer's key and value caches, [num_blocks, block_size, Hkv, D] views of vLLM's FlashAttention cache
    ([num_blocks, Hkv, block_size, 2 D]), FP8 where the cache is (as FlashAttention's forward reads it)."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    key_cache = canonicalize_singleton_dim_strides(key_cache)
    value_cache = canonicalize_singleton_dim_strides(value_cache)
    if fp8_dtype is not None:
        key_cache, value_cache = key_cache.view(fp8_dtype), value_cache.view(fp8_dtype)
    return key_cache, value_cache
