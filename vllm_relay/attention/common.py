"""What both relay backends (CUDA and CPU) declare and check, in one place."""

import torch
from vllm.logger import init_logger

# A child of vLLM's logger, so our lines appear with vLLM's formatting and level.
logger = init_logger("vllm.relay")


def log_active(implementation: str) -> None:
    logger.info_once("vllm-relay: relay attention backend active, implementation: %s", implementation)


# The FP8 KV-cache dtypes a backend may read, by vLLM's names.
FP8_KV = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def layer_impls(vllm_config, layer_names) -> list:
    """The attention implementations (`Attention.impl`) of these layers, built with the model."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    return [layer.impl for layer in get_layers_from_vllm_config(vllm_config, Attention, layer_names).values()]


def any_sinks(impls) -> bool:
    """Whether any of these attention implementations has sinks: they join one partial's softmax
    (the context call's), so their steps plan no joint call."""
    return any(getattr(impl, "sinks", None) is not None for impl in impls)


def window_of(impls) -> int:
    """The sliding window of these attention implementations (one KV-cache group's layers) in tokens, 0
    for none: vLLM's FlashAttention keeps `(W - 1, 0)` (`(-1, -1)`: none), its CPU backend W (-1: none).
    Layers of one group with different windows are refused (their levels' key starts would differ)."""
    windows = set()
    for impl in impls:
        w = getattr(impl, "sliding_window", None)
        windows.add(0 if w in (None, -1, (-1, -1)) else w[0] + 1 if isinstance(w, (tuple, list)) else int(w))
    if len(windows) > 1:
        raise NotImplementedError(f"vllm-relay: layers of one KV-cache group with different sliding windows "
                                  f"({sorted(windows)})")
    return windows.pop() if windows else 0


def check_layer(backend: str, *, alibi_slopes, attn_type, kv_sharing_target_layer_name=None) -> None:
    """Reject, at start-up with a clear message, layer features relay does not compute exactly.
    (Soft-capping, sinks and sliding windows both backends compute.)"""
    from vllm.v1.attention.backend import AttentionType

    unsupported = []
    if alibi_slopes is not None:
        unsupported.append("ALiBi")
    if attn_type != AttentionType.DECODER:
        unsupported.append(f"attention type {attn_type!r} (decoder self-attention only)")
    if kv_sharing_target_layer_name is not None:
        unsupported.append("cross-layer KV sharing")
    if unsupported:
        raise NotImplementedError(
            f"The relay attention backend ({backend}) does not support: {', '.join(unsupported)}. "
            "Use another --attention-backend for this model."
        )


# The drafter models relay serves (speculative_config.method -> the name in messages): vLLM's EAGLE family,
# drafters over the target's hidden states whose layers run on the target's attention backend.
DRAFTERS = {"eagle3": "EAGLE-3", "mtp": "MTP"}


def drafter_unsupported(spec) -> str | None:
    """Why relay cannot serve this drafter model, or None. Served: EAGLE-3 heads and MTP layers
    (drafters over the target's hidden states, vLLM's EAGLE family; their layers on relay,
    `hooks.frontend.select_drafter_backend`; a registered prompt's shared blocks end one token early,
    `validate.drafter_lookahead`), any number of draft tokens a step: on the GPU through Model Runner
    V2's speculator (`hooks/drafter.py`), on the CPU through vLLM's V1 runner
    (`hooks.runner.DraftPositions`)."""
    if spec.method not in DRAFTERS:
        return f"speculative decoding with {spec.method} drafts (served: n-gram, EAGLE-3 and MTP drafts)"
    return None


def check_engine() -> None:
    """Reject, at start-up, engine features relay does not compute exactly (model build time). The
    KV cache is the model's dtype or FP8 (which FP8 formats, the backend's `supports_kv_cache_dtype`
    says); speculative decoding with n-gram drafts (from the token ids, no drafter model), EAGLE-3 or
    MTP; plain and M-RoPE positions (the latter shifted in every section)."""
    from vllm.config import get_current_vllm_config

    vllm_config = get_current_vllm_config()
    model_config = vllm_config.model_config
    unsupported = []
    spec = vllm_config.speculative_config
    if spec is not None and spec.method != "ngram" and (why := drafter_unsupported(spec)):
        unsupported.append(why)
    if getattr(model_config, "uses_xdrope_dim", 0):
        unsupported.append("XD-RoPE position encodings (plain and M-RoPE positions are shifted)")
    cache_dtype = vllm_config.cache_config.cache_dtype
    if cache_dtype not in ("auto", str(model_config.dtype).removeprefix("torch."), *FP8_KV):
        unsupported.append(f"kv_cache_dtype={cache_dtype!r} other than the model's {model_config.dtype} "
                           "or fp8 / fp8_e4m3 / fp8_e5m2")
    if getattr(vllm_config.parallel_config, "use_ubatching", False):
        unsupported.append("micro-batching (dual-batch overlap splits a step the relay plan covers whole)")
    if unsupported:
        raise NotImplementedError(f"The relay attention backend does not support: {'; '.join(unsupported)}.")
