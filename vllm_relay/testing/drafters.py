"""Drafter models for speculative decoding, built locally (`models.get_model` names them): EAGLE-3 heads
(a model of their own) and MiMo with its MTP layer (in the target's own checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_relay.testing.models import (
    DRAFTERS,
    MTP_MODELS,
    SEED,
    SHAPE_DRAFTERS,
    SHAPE_MODELS,
    TINY_MODELS,
    _llama_config,
    _write_generation_config,
)
from vllm_relay.testing.tokenizer import build_tokenizer


def build(name: str, path: str | Path) -> Path:
    if name in DRAFTERS:
        return build_eagle3_head(name, path)
    if name in SHAPE_DRAFTERS:
        return build_eagle3_shape_config(name, path)
    return build_mtp_model(name, path)


def _write_eagle3_config(path: Path, spec: dict, aux_layer_ids: list[int]) -> dict:
    """Write (and return) the config.json of an EAGLE-3 head for the model `spec`, with the tokenizer at
    `path`: one decoder layer, the target's vocabulary as its draft vocabulary (no draft-to-target id map),
    the hidden states after the target's layers `aux_layer_ids`."""
    config = _llama_config(path, **spec).to_dict()
    config.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1,
                  draft_vocab_size=config["vocab_size"], eagle_aux_hidden_state_layer_ids=aux_layer_ids,
                  target_hidden_size=spec["hidden_size"])
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return config


def build_eagle3_head(name: str, path: str | Path, seed: int = SEED) -> Path:
    """An EAGLE-3 head for the tiny model `DRAFTERS[name]`: its tokenizer and vocabulary (no draft-to-target
    id map), the hidden states after its layers 0-2, random weights in the names vLLM's
    `Eagle3LlamaForCausalLM` loads. Its drafts are mostly rejected; tests compare the drafts themselves."""
    import torch
    from safetensors.torch import save_file

    spec = TINY_MODELS[DRAFTERS[name]]
    path = build_tokenizer(path, seed=seed, model_max_length=spec["max_position_embeddings"])
    config = _write_eagle3_config(path, spec, [0, 1, 2])
    h, inter, hd = spec["hidden_size"], spec["intermediate_size"], spec["head_dim"]
    q, kv = spec["num_attention_heads"] * hd, spec["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(seed)
    shapes = {"self_attn.q_proj": (q, 2 * h), "self_attn.k_proj": (kv, 2 * h),
              "self_attn.v_proj": (kv, 2 * h), "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
              "mlp.down_proj": (h, inter)}
    weights = {f"layers.0.{k}.weight": torch.randn(*v, generator=g) * spec["initializer_range"]
               for k, v in shapes.items()}
    for norm in ("input_layernorm", "post_attention_layernorm", "hidden_norm"):
        weights[f"layers.0.{norm}.weight"] = torch.ones(h)
    weights["norm.weight"] = torch.ones(h)
    weights["fc.weight"] = torch.randn(h, 3 * h, generator=g) * spec["initializer_range"]
    weights["lm_head.weight"] = torch.randn(config["vocab_size"], h, generator=g) * spec["initializer_range"]
    save_file(weights, str(path / "model.safetensors"))
    return path


def build_eagle3_shape_config(name: str, path: str | Path, seed: int = SEED) -> Path:
    """An EAGLE-3 head's config for the shape model `SHAPE_DRAFTERS[name]` (no weights: dummy ones, the
    target's vocabulary as its draft vocabulary, the hidden states of three of the target's layers)."""
    spec = SHAPE_MODELS[SHAPE_DRAFTERS[name]]
    path = build_tokenizer(path, seed=seed, model_max_length=spec["max_position_embeddings"],
                           vocab_size=spec["vocab_size"])
    layers = spec["num_hidden_layers"]
    _write_eagle3_config(path, spec, [2, layers // 2, layers - 3])
    return path


def build_mtp_model(name: str, path: str | Path, seed: int = SEED) -> Path:
    """MiMo (`MTP_MODELS[name]`): Qwen2's architecture named `MiMoForCausalLM`, with
    `num_nextn_predict_layers` 1; the tiny one gets random weights and its MTP layer
    (`model.mtp_layers.0.`: a decoder layer over the token's embedding and the target's last hidden state,
    as vLLM's `MiMoMTP` loads it) random ones of its own; the shape one is config only (dummy weights)."""
    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    spec = MTP_MODELS[name]
    shape = name.endswith("-shape")
    pad = {"vocab_size": spec["vocab_size"]} if shape else {}
    path = build_tokenizer(path, seed=seed, model_max_length=spec["max_position_embeddings"], **pad)
    config = _llama_config(path, "Qwen2ForCausalLM", **spec)
    config.num_nextn_predict_layers = 1
    if not shape:
        torch.manual_seed(seed)
        transformers.Qwen2ForCausalLM(config).save_pretrained(path, safe_serialization=True)
    # After the model's save, which names its own class and writes a generation config of its own.
    config.architectures = ["MiMoForCausalLM"]
    config.save_pretrained(path)
    _write_generation_config(config, path)
    if shape:
        return path
    one_layer = transformers.Qwen2Config(**{**config.to_dict(), "num_hidden_layers": 1, "layer_types": None})
    torch.manual_seed(seed + 1)
    layer = transformers.Qwen2ForCausalLM(one_layer).state_dict()
    file = path / "model.safetensors"
    weights = load_file(file)
    mtp = "model.mtp_layers.0."
    weights |= {mtp + k.removeprefix("model.layers.0."): v.clone() for k, v in layer.items()
                if k.startswith("model.layers.0.")}
    h, g = spec["hidden_size"], torch.Generator().manual_seed(seed + 2)
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        weights[f"{mtp}{norm}.weight"] = torch.ones(h)
    weights[f"{mtp}input_proj.weight"] = torch.randn(h, 2 * h, generator=g) * spec["initializer_range"]
    save_file(weights, str(file), metadata={"format": "pt"})
    return path
