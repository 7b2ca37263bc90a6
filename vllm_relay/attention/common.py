"""What both relay backends (CUDA and CPU) declare and check, in one place."""

from vllm.logger import init_logger

# A child of vLLM's logger, so our lines appear with vLLM's formatting and level.
logger = init_logger("vllm.relay")


def log_active(implementation: str) -> None:
    logger.info_once("vllm-relay: relay attention backend active, implementation: %s", implementation)


def check_layer(backend: str, *, alibi_slopes, sliding_window, logits_soft_cap, attn_type, sinks=None,
                kv_sharing_target_layer_name=None) -> None:
    """Reject, at start-up with a clear message, layer features relay does not compute exactly."""
    from vllm.v1.attention.backend import AttentionType

    unsupported = []
    if alibi_slopes is not None:
        unsupported.append("ALiBi")
    if sliding_window is not None:
        unsupported.append(f"sliding window ({sliding_window})")
    if logits_soft_cap:
        unsupported.append(f"logits soft-capping ({logits_soft_cap})")
    if attn_type != AttentionType.DECODER:
        unsupported.append(f"attention type {attn_type!r} (decoder self-attention only)")
    if sinks is not None:
        unsupported.append("attention sinks")
    if kv_sharing_target_layer_name is not None:
        unsupported.append("cross-layer KV sharing")
    if unsupported:
        raise NotImplementedError(
            f"The relay attention backend ({backend}) does not support: {', '.join(unsupported)}. "
            "Use another --attention-backend for this model."
        )


def relay_config():
    """The RelayConfig of the engine being built (worker side, during model construction)."""
    from vllm.config import get_current_vllm_config

    from vllm_relay.config import RelayConfig

    return RelayConfig.from_vllm(get_current_vllm_config().additional_config)


def allocate_system_store(num_kv_heads: int, head_size: int):
    """This layer's system-prompt K/V store: two [max_prompts, max_prompt_tokens, kv_heads, D].

    Allocated while the model is built, before vLLM measures free memory, so the paged KV cache
    is sized around it. Each tensor-parallel rank holds its own heads (num_kv_heads is per rank).
    """
    import torch
    from vllm.config import get_current_vllm_config

    vllm_config = get_current_vllm_config()
    model_config = vllm_config.model_config
    unsupported = []
    if vllm_config.speculative_config is not None:
        unsupported.append("speculative decoding (its drafters do not shift system-prompt positions)")
    if model_config.uses_mrope or getattr(model_config, "uses_xdrope_dim", 0):
        unsupported.append("M-RoPE / XD-RoPE position encodings (only plain positions are shifted)")
    if vllm_config.cache_config.cache_dtype not in ("auto", str(model_config.dtype).removeprefix("torch.")):
        unsupported.append(f"kv_cache_dtype={vllm_config.cache_config.cache_dtype!r} other than the "
                           f"model's {model_config.dtype} (the system store holds the model dtype)")
    if unsupported:
        raise NotImplementedError(f"The relay attention backend does not support: {'; '.join(unsupported)}.")
    cfg = relay_config()
    shape = (cfg.max_prompts, cfg.max_prompt_tokens, num_kv_heads, head_size)
    dtype, device = vllm_config.model_config.dtype, vllm_config.device_config.device
    k, v = torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)
    logger.info_once("vllm-relay: system-prompt KV store: %d prompts x %d tokens, %.1f MiB per layer",
                     cfg.max_prompts, cfg.max_prompt_tokens, 2 * k.numel() * k.element_size() / 2**20)
    return cfg, k, v


def relay_plan(cm, step, cfg, scheduler_metadata=None):
    """The step's RelayPlan: each request's own paged KV, plus the grouped system part."""
    from vllm_relay.ops import RelayPlan, plan_system_attention

    system = None
    if step is not None and step.has_system:
        system = plan_system_attention(step.token_slot, step.slot_lens, cfg.max_prompt_tokens,
                                       cfg.page_size, cm.query_start_loc.device)
    return RelayPlan(cu_seqlens_q=cm.query_start_loc, seqused_k=cm.seq_lens,
                     max_seqlen_q=cm.max_query_len, max_seqlen_k=cm.max_seq_len,
                     block_table=cm.block_table_tensor, system=system,
                     scheduler_metadata=scheduler_metadata)


def capture_fill(step, key, value, k_sys, v_sys) -> None:
    """Copy the fill requests' post-RoPE keys and values into their system slots."""
    if step is None or step.fill_src is None:
        return
    k_sys.view(-1, *k_sys.shape[2:])[step.fill_dst] = key[step.fill_src]
    v_sys.view(-1, *v_sys.shape[2:])[step.fill_dst] = value[step.fill_src]
