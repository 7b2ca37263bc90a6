"""Model folders for tests and benchmarks, built locally and cached.

Nothing can be downloaded from a model hub here, so every model the tests or
benchmarks load is built by this module:

- ``tiny-llama-mha`` / ``tiny-llama-gqa``: random LlamaForCausalLM weights
  (hidden 256, 4 query heads of 64, 4 layers) with 4 or 2 KV heads, float32,
  about 17 MB. Small enough for CPU tests, with a real head_dim (64). vLLM's
  ``dtype="auto"`` turns float32 checkpoints into bfloat16, so pass
  ``dtype="float32"`` to compare with transformers token for token.
- ``tiny-gemma2-softcap`` / ``tiny-granite-sinks``: the same scale (GQA, 4 layers)
  in the architectures of two attention features relay computes: Gemma 2's
  logit soft-capping (every layer global) and Granite's attention sinks.
- ``tiny-gemma2-window``: Gemma 2 with a 64-token sliding window in every other
  layer (two KV-cache groups in vLLM).
- ``tiny-llama-loops``: the GQA model with Llama's default initializer, whose
  greedy continuations loop, for n-gram speculative decoding.
- ``tiny-deepseek-v2``: DeepSeek-V2's latent attention (MLA) at FlashAttention-3's
  sizes (16 heads, a 512 + 64 latent), 2 layers, for relay's MLA backend on CUDA.
- ``tiny-qwen2.5-vl``: Qwen2.5-VL (M-RoPE positions in three sections) with a
  two-block vision tower, for text-only prompts (engines with
  ``limit_mm_per_prompt`` 0 per modality: ``VL_ENGINE``); the tokenizer gains
  Qwen's four vision tokens (ids 3072-3075).
- ``tiny-llama-gqa-eagle3``: an EAGLE-3 head (random weights) for ``tiny-llama-gqa``, for
  speculative decoding with a drafter model; ``tiny-mimo-mtp``: MiMo (Qwen2's architecture, GQA,
  the tiny size) with one MTP layer in its checkpoint, for MTP drafts (``drafters.py`` builds both).
- ``llama-2-7b-shape`` / ``llama-3-8b-shape`` / ``llama-2-13b-shape`` /
  ``llama-2-70b-shape``: config.json only, for ``--load-format dummy`` on a
  GPU, so benchmarks run at real shapes (MHA 32/32, GQA 32/8, MHA 40/40 for
  tensor parallelism 2, GQA 64/8 for tensor parallelism 4) without real weights.
- ``gemma-3-12b-shape`` (five sliding-window layers of 1024 tokens to each global one, head size
  256), ``qwen2.5-vl-7b-shape`` (M-RoPE, with its vision tower; text prompts: ``VL_ENGINE``) and
  ``llama-3-8b-shape-eagle3`` (an EAGLE-3 head for ``llama-3-8b-shape``), ``mimo-7b-shape`` (MiMo-7B
  with its MTP layer): the same, for the features relay serves at the sizes users serve them;
  ``deepseek-v2-lite-shape`` (DeepSeek-V2-Lite's latent attention, dense MLPs): an MLA model.

Every folder carries the tokenizer from ``tokenizer.py`` (3072 tokens). In the
shape folders it is padded with filler words up to ``vocab_size``, so every id a
dummy model samples decodes to text, as with a real tokenizer (otherwise vLLM's
incremental detokenizer re-decodes the whole prompt at every step, a front-end
cost that grows with the prompt length and distorts throughput comparisons).

``get_model(name)`` builds a folder once per cache key (these sources and the
library versions) and renames it into place, so concurrent test workers never
see a half-written folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path

from vllm_relay.testing.tokenizer import CHAT_TOKENS, build_tokenizer

# Part of the cache key, with the sources below and the writers' versions; bump
# it to force a rebuild for a reason the key cannot see.
FIXTURE_VERSION = "1"
SEED = 0

_TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    # With Llama's default 0.02 the residual stream is dominated by the token
    # embedding, so greedy decoding of a random model falls into a 1-2 token
    # loop almost at once; with 0.1 attention and MLPs matter and the output
    # keeps varying (tests check a greedy continuation is not a short loop).
    initializer_range=0.1,
    tie_word_embeddings=False,
    dtype="float32",
)

TINY_MODELS = {
    "tiny-llama-mha": dict(_TINY, num_key_value_heads=4),
    "tiny-llama-gqa": dict(_TINY, num_key_value_heads=2),  # GQA ratio 2
    # Gemma 2's attention soft-capping on every layer (all global: no sliding window), with a cap of 5:
    # the scores of these random weights are a few units, which Gemma 2's own cap (50) leaves
    # nearly as they are. Its embeddings are tied, as vLLM's Gemma 2 loads them.
    "tiny-gemma2-softcap": dict(_TINY, num_key_value_heads=2, attn_logit_softcapping=5.0,
                                final_logit_softcapping=30.0, query_pre_attn_scalar=64,
                                layer_types=["full_attention"] * 4, sliding_window=None, tie_word_embeddings=True),
    # Gemma 2 with a 64-token window in every other layer (Gemma 3 and gpt-oss mix them too): vLLM keeps
    # the window layers' KV in a KV-cache group of their own, whose blocks behind the window it frees.
    "tiny-gemma2-window": dict(_TINY, num_key_value_heads=2, attn_logit_softcapping=None,
                               final_logit_softcapping=None, query_pre_attn_scalar=64, sliding_window=64,
                               layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=True),
    # Granite with a sink per head (`attention_sinks`; their weights, 2 to 6, are added to the
    # checkpoint: transformers' Granite has none), its attention scale 1 / sqrt(head_dim).
    "tiny-granite-sinks": dict(_TINY, num_key_value_heads=2, attention_sinks=True, attention_multiplier=0.125),
    # gpt-oss's attention in a dense model: sinks in every layer, a 64-token window in every other one
    # (Granite's `layer_types`, as vLLM reads them).
    "tiny-granite-window-sinks": dict(_TINY, num_key_value_heads=2, attention_sinks=True, attention_multiplier=0.125,
                                      sliding_window=64, layer_types=["sliding_attention", "full_attention"] * 2),
    # Llama's default initializer (0.02): greedy continuations fall into short loops, which n-gram
    # speculative decoding drafts and the model accepts (the 0.1 models' continuations keep varying).
    "tiny-llama-loops": dict(_TINY, num_key_value_heads=2, initializer_range=0.02),
    # DeepSeek-V2's multi-head latent attention at its sizes (a latent of 512 and 64 rotary values a token,
    # heads of 128 + 64 and values of 128: FlashAttention's MLA prefill takes no others; 16 query heads, as
    # DeepSeek-V2-Lite or V3 over 8 GPUs), 2 layers, dense MLPs
    # (`first_k_dense_replace` = the layer count), no query LoRA: for relay's MLA backend on CUDA.
    "tiny-deepseek-v2": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=16,
                             num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                             qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=2, n_routed_experts=4,
                             n_shared_experts=1, moe_intermediate_size=128, num_experts_per_tok=2,
                             max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
                             initializer_range=0.1, tie_word_embeddings=False, dtype="float32"),
}
ARCHITECTURES = {"tiny-gemma2-softcap": "Gemma2ForCausalLM", "tiny-gemma2-window": "Gemma2ForCausalLM",
                 "tiny-granite-sinks": "GraniteForCausalLM", "tiny-granite-window-sinks": "GraniteForCausalLM",
                 "tiny-deepseek-v2": "DeepseekV2ForCausalLM"}

# What every shape has in common (Llama-2's vocab and RoPE; Llama-3 overrides them). The context
# length is 16384 for all: room for 8k-token system prompts plus output (Llama-3-8B has 8192).
_SHAPE = dict(
    vocab_size=32000,
    max_position_embeddings=16384,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    dtype="bfloat16",
)

SHAPE_MODELS = {
    "llama-2-7b-shape": dict(_SHAPE, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=32),
    "llama-3-8b-shape": dict(_SHAPE, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                             rope_theta=500000.0),
    # Tensor-parallel shapes.
    "llama-2-13b-shape": dict(_SHAPE, hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                              num_attention_heads=40, num_key_value_heads=40),
    "llama-2-70b-shape": dict(_SHAPE, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                              num_attention_heads=64, num_key_value_heads=8),
}

# Other architectures at real sizes (config only, as above): the features relay serves.
SHAPE_MODELS["gemma-3-12b-shape"] = dict(
    vocab_size=262208, max_position_embeddings=16384, hidden_size=3840, intermediate_size=15360,
    num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256, sliding_window=1024,
    query_pre_attn_scalar=256, rms_norm_eps=1e-6, tie_word_embeddings=True, dtype="bfloat16")
# gpt-oss-20b's attention (64 query and 8 KV heads of 64, a sink per head, a 128-token window in every
# other layer, 24 layers, its vocabulary) with a dense MLP of its active size (4 experts of 2880) in
# place of its MoE: Granite's architecture, which vLLM gives per-layer windows and sinks.
SHAPE_MODELS["gpt-oss-20b-attention-shape"] = dict(
    vocab_size=201088, max_position_embeddings=16384, hidden_size=2880, intermediate_size=4 * 2880,
    num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
    layer_types=["sliding_attention", "full_attention"] * 12, attention_sinks=True, attention_multiplier=0.125,
    rope_theta=150000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, dtype="bfloat16")
# DeepSeek-V2-Lite's multi-head latent attention (16 query heads; a latent of 512 and 64 rotary values a
# token, cached as one 576-value vector; no query LoRA) with the dense MLP of its first layer in all 27 (its
# MoE layers replaced: `first_k_dense_replace` = the layer count), its vocabulary: MLA at its real size.
SHAPE_MODELS["deepseek-v2-lite-shape"] = dict(
    vocab_size=102400, max_position_embeddings=16384, hidden_size=2048, intermediate_size=10944,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
    moe_intermediate_size=1408, num_experts_per_tok=6, first_k_dense_replace=27, rope_theta=10000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, dtype="bfloat16")
SHAPE_CONFIGS = {"gemma-3-12b-shape": "Gemma3TextConfig"}  # (Gemma3Config is the multimodal model's)
SHAPE_ARCHITECTURES = {"gemma-3-12b-shape": "Gemma3ForCausalLM", "gpt-oss-20b-attention-shape": "GraniteForCausalLM",
                       "deepseek-v2-lite-shape": "DeepseekV2ForCausalLM"}

# Qwen2.5-VL: the text model of the tiny ones (head size 32: M-RoPE sections of 4, 6 and 6 rotary pairs)
# and a vision tower of two blocks, for text-only prompts.
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VL_MODELS = {
    "tiny-qwen2.5-vl": (
        dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, initializer_range=0.1,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]}),
        dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14, spatial_merge_size=2,
             temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1], out_hidden_size=128,
             initializer_range=0.1),
    ),
}
# Qwen2.5-VL-7B's shape, config only (its text model's vocabulary includes the vision tokens).
VL_SHAPE_MODELS = {
    "qwen2.5-vl-7b-shape": (
        dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
             num_key_value_heads=4, max_position_embeddings=16384, rms_norm_eps=1e-6, vocab_size=152064,
             rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                              "mrope_section": [16, 24, 24]}),
        dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
             spatial_merge_size=2, temporal_patch_size=2, window_size=112,
             fullatt_block_indexes=[7, 15, 23, 31], out_hidden_size=3584),
    ),
}
VL_ENGINE = {"limit_mm_per_prompt": {"image": 0, "video": 0}}  # text only: no image processor is made
# Qwen2.5-VL's image processor, as its checkpoints configure it (images need torchvision: the GPU host's).
VL_IMAGE_PROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
                      "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                      "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                      "image_std": [0.26862954, 0.26130258, 0.27577711]}

# EAGLE-3 heads (a drafter model: one decoder layer over the token's embedding and three of the target's
# hidden states), random weights: name -> the tiny model it drafts for.
DRAFTERS = {"tiny-llama-gqa-eagle3": "tiny-llama-gqa"}
SHAPE_DRAFTERS = {"llama-3-8b-shape-eagle3": "llama-3-8b-shape"}  # config only: dummy weights
# MiMo (Qwen2's architecture) with one MTP layer in its checkpoint, a drafter vLLM builds from the target's
# own folder (`--speculative-config '{"method": "mtp", "num_speculative_tokens": 1}'`): the tiny one with
# random weights, and MiMo-7B's shape (config only).
MTP_MODELS = {
    "tiny-mimo-mtp": dict(_TINY, num_key_value_heads=2),
    "mimo-7b-shape": dict(_SHAPE, hidden_size=4096, intermediate_size=11008, num_hidden_layers=36,
                          num_attention_heads=32, num_key_value_heads=8, vocab_size=151680,
                          rope_theta=640000.0),
}

MODEL_NAMES = [*TINY_MODELS, *VL_MODELS, *SHAPE_MODELS, *VL_SHAPE_MODELS, *DRAFTERS, *SHAPE_DRAFTERS,
               *MTP_MODELS]


def _llama_config(tok_path: Path, arch: str = "LlamaForCausalLM", config_cls: str | None = None, **kwargs):
    """A config of `arch` (Llama's by default; its class `config_cls`, else the architecture's name with
    "Config") whose bos/eos/pad ids come from the tokenizer at ``tok_path``."""
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_path)
    kwargs.setdefault("vocab_size", len(tok))
    assert len(tok) <= kwargs["vocab_size"], "tokenizer ids must fit in the model's vocab"
    return getattr(transformers, config_cls or arch.replace("ForCausalLM", "Config"))(
        architectures=[arch],
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **kwargs,
    )


def _write_generation_config(config, path: Path) -> None:
    """Chat turns end with <|end|>, so generation stops there as well as at </s>."""
    from transformers import AutoTokenizer, GenerationConfig

    end_id = AutoTokenizer.from_pretrained(path).convert_tokens_to_ids(CHAT_TOKENS[-1])
    gen = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[config.eos_token_id, end_id],
        pad_token_id=config.pad_token_id,
    )
    gen.save_pretrained(path)


def build_tiny_model(name: str, path: str | Path, seed: int = SEED) -> Path:
    """Write tokenizer, config and random safetensors weights for a tiny model."""
    import torch
    import transformers

    spec = TINY_MODELS[name]
    arch = ARCHITECTURES.get(name, "LlamaForCausalLM")
    path = build_tokenizer(path, seed=seed, model_max_length=spec["max_position_embeddings"])
    config = _llama_config(path, arch, **spec)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config)
    model.save_pretrained(path, safe_serialization=True)
    if spec.get("attention_sinks"):
        _add_sinks(path, config, torch.Generator().manual_seed(seed))
    _write_generation_config(config, path)
    return path


def build_vl_model(name: str, path: str | Path, seed: int = SEED) -> Path:
    """Write tokenizer (with Qwen's vision tokens), config and random weights: a tiny Qwen2.5-VL; a
    shape model (`VL_SHAPE_MODELS`): tokenizer and config only, the tokenizer padded to its vocabulary."""
    import torch
    from tokenizers import AddedToken, Tokenizer
    from transformers import AutoTokenizer, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    shape = name in VL_SHAPE_MODELS
    text, vision = (VL_SHAPE_MODELS if shape else VL_MODELS)[name]
    pad = {"vocab_size": text["vocab_size"] - len(VISION_TOKENS)} if shape else {}
    path = build_tokenizer(path, seed=seed, model_max_length=text["max_position_embeddings"], **pad)
    tk = Tokenizer.from_file(str(path / "tokenizer.json"))
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    tk.save(str(path / "tokenizer.json"))
    for file in ("tokenizer_config.json", "special_tokens_map.json"):
        cfg = json.loads((path / file).read_text())
        cfg["additional_special_tokens"] = CHAT_TOKENS + VISION_TOKENS
        (path / file).write_text(json.dumps(cfg, indent=2))
    tok = AutoTokenizer.from_pretrained(path)
    ids = dict(zip(("vision_start", "vision_end", "image", "video"),
                   map(tok.convert_tokens_to_ids, VISION_TOKENS)))
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                   pad_token_id=tok.pad_token_id)
    config = Qwen2_5_VLConfig(architectures=["Qwen2_5_VLForConditionalGeneration"],
                              text_config=dict(text, vocab_size=len(tok), **special), vision_config=vision,
                              **{f"{k}_token_id": v for k, v in ids.items()}, tie_word_embeddings=False,
                              dtype="bfloat16" if shape else "float32", **special)
    if shape:
        config.save_pretrained(path)
    else:
        torch.manual_seed(seed)
        Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path, safe_serialization=True)
    _write_generation_config(config.text_config, path)
    (path / "preprocessor_config.json").write_text(json.dumps(VL_IMAGE_PROCESSOR, indent=2))
    return path


def _add_sinks(path: Path, config, gen) -> None:
    """Each layer's sinks (one logit per query head, 2 to 6) into the checkpoint, as vLLM names them."""
    import torch
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    weights = load_file(file)
    for i in range(config.num_hidden_layers):
        weights[f"model.layers.{i}.self_attn.sinks"] = 2 + 4 * torch.rand(config.num_attention_heads, generator=gen)
    save_file(weights, file, metadata={"format": "pt"})


def build_shape_config(name: str, path: str | Path, seed: int = SEED) -> Path:
    """Write tokenizer and config (no weights) for ``--load-format dummy``."""
    spec = SHAPE_MODELS[name]
    path = build_tokenizer(path, seed=seed, model_max_length=spec["max_position_embeddings"],
                           vocab_size=spec["vocab_size"])
    config = _llama_config(path, SHAPE_ARCHITECTURES.get(name, "LlamaForCausalLM"), SHAPE_CONFIGS.get(name),
                           **spec)
    config.save_pretrained(path)
    _write_generation_config(config, path)
    return path


def build(name: str, path: str | Path) -> Path:
    if name in TINY_MODELS:
        return build_tiny_model(name, path)
    if name in VL_MODELS or name in VL_SHAPE_MODELS:
        return build_vl_model(name, path)
    if name in SHAPE_MODELS:
        return build_shape_config(name, path)
    if name in DRAFTERS or name in SHAPE_DRAFTERS or name in MTP_MODELS:
        from vllm_relay.testing import drafters

        return drafters.build(name, path)
    raise KeyError(f"unknown test model {name!r}; known: {', '.join(MODEL_NAMES)}")


def cache_root() -> Path:
    """$VLLM_RELAY_CACHE, else <repo>/.cache/models in a checkout, else ~/.cache/vllm-relay."""
    from vllm_relay import envs

    if env := envs.VLLM_RELAY_CACHE:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    if (repo / ".git").exists() and (repo / "vllm_relay").is_dir():
        return repo / ".cache" / "models"
    return Path.home() / ".cache" / "vllm-relay"


def cache_key() -> str:
    """Changes whenever the built files could: our sources or the writers' versions."""
    h = hashlib.sha256(json.dumps([FIXTURE_VERSION, SEED]).encode())
    for lib in ("tokenizers", "transformers", "safetensors", "torch"):
        h.update(version(lib).encode())
    here = Path(__file__).parent
    for source in ("models.py", "drafters.py", "tokenizer.py", "corpus.txt"):
        h.update((here / source).read_bytes())
    return h.hexdigest()[:10]


def get_model(name: str, cache_dir: str | Path | None = None) -> str:
    """Path of the built model folder ``name``, building it on first use.

    The build goes to a temporary folder next to the final one and is renamed
    into place; if another process won the race, its folder is kept and ours
    is dropped. Stale builds (other cache keys) are left alone, not deleted,
    since another checkout may still use them.
    """
    if name not in MODEL_NAMES:
        raise KeyError(f"unknown test model {name!r}; known: {', '.join(MODEL_NAMES)}")
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    final = root / f"{name}-{cache_key()}"
    if final.is_dir():
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
    try:
        build(name, tmp)
        for f in tmp.iterdir():
            f.chmod(0o644)  # transformers writes model.safetensors as 0600
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)
