"""Everything relay checks before it serves: the configuration and each system prompt as tokens.

`validate_engine_config` runs in the front end on the VllmConfig built from the user's arguments
(hooks/frontend.py), before any engine process starts: a bad relay configuration fails there in
seconds, with the same message the engine core would give after loading the model, profiling
memory and warming up. The engine core resolves prompts with the same `resolve_prompt`, for the
configured ones (a VllmConfig can also reach it without the front end) and for run-time
registrations.

Checked, in order: the "relay" section of additional_config and the VLLM_RELAY_* variables
(RelayConfig: keys, limits, the prompts file, each prompt's form); then each prompt tokenized with
the model's tokenizer and chat template, against max_prompt_tokens, the model's vocabulary, the KV
cache block (relay shares whole blocks; in the front end only when --block-size is given) and
max_model_len. (The table of every check and its message is in README.md, "Bad input".)
"""

from __future__ import annotations

from typing import Any

from vllm_relay import envs
from vllm_relay.config import RelayConfig
from vllm_relay.system_prompts.fill import Encode, RenderChat, prompt_token_ids


class PromptTools:
    """The model's tokenizer and chat template as the two callables `prompt_token_ids` takes.

    The tokenizer is loaded on first use only (prompts given as token ids need none), through
    vLLM's cached loader, so the front end does not load it twice.
    """

    def __init__(self, vllm_config) -> None:
        self.vllm_config = vllm_config
        self._tokenizer: Any = None

    def __call__(self) -> tuple[Encode | None, RenderChat | None]:
        """(encode, render_chat); (None, None) when the engine has no tokenizer (skip_tokenizer_init)."""
        model_config = self.vllm_config.model_config
        if self._tokenizer is None:
            from vllm.tokenizers.registry import cached_tokenizer_from_config

            self._tokenizer = cached_tokenizer_from_config(model_config) or False
        tok = self._tokenizer
        if tok is False:
            return None, None

        def encode(text: str, add_special_tokens: bool) -> list[int]:
            return list(tok.encode(text, add_special_tokens=add_special_tokens))

        def render_chat(messages: list[dict[str, str]]) -> str:
            from vllm.renderers.hf import safe_apply_chat_template

            return safe_apply_chat_template(model_config, tok, messages, tokenize=False,
                                            add_generation_prompt=True)

        return encode, render_chat


def drafter_lookahead(vllm_config) -> int:
    """1 where a drafter model computes a token's draft KV from the next token (EAGLE's family: vLLM
    drops a prefix-cache hit's last block for them), else 0: the tokens a registered prompt keeps back
    from its shared blocks, so that the token after them is the prompt's own, the same for every
    request (engine/pages.py)."""
    spec = vllm_config.speculative_config
    if spec is None:
        return 0
    drops = getattr(spec, "use_eagle_block_drop", spec.use_eagle)
    return 1 if drops() else 0


def resolve_prompt(name: str, spec: Any, config: RelayConfig, vllm_config, tools: PromptTools,
                   block_size: int | None) -> list[int]:
    """The token ids of system prompt `name` (a spec checked by RelayConfig / check_prompt_spec),
    or ValueError saying why this engine cannot use it. `block_size`: the KV cache block, when
    known (None skips that check)."""
    what = f"system prompt {name!r}"
    encode, render_chat = tools() if not isinstance(spec, list) else (None, None)
    ids = prompt_token_ids(what, spec, config.max_prompt_tokens, encode, render_chat)
    vocab = vllm_config.model_config.get_vocab_size()
    if max(ids) >= vocab:
        raise ValueError(f"{what}: token id {max(ids)} is out of the model's vocabulary (size {vocab})")
    lookahead = drafter_lookahead(vllm_config)
    if block_size is not None and len(ids) - lookahead < block_size:
        drafter = f", and one more with {vllm_config.speculative_config.method} drafts" if lookahead else ""
        raise ValueError(
            f"{what}: {len(ids)} tokens, fewer than one KV cache block ({block_size} tokens{drafter}): "
            f"relay shares whole blocks, so it would share nothing"
        )
    max_model_len = vllm_config.model_config.max_model_len
    if len(ids) >= max_model_len:
        raise ValueError(
            f"{what}: {len(ids)} tokens leave no room for a request's own tokens within "
            f"max_model_len={max_model_len}"
        )
    # Without chunked prefill vLLM itself requires max_num_batched_tokens >= max_model_len, so a
    # prompt that fits max_model_len is always fillable in one step.
    return ids


def validate_engine_config(vllm_config) -> dict[str, list[int]]:
    """Check the whole relay configuration of an engine; return its start-up prompts as token ids.

    Raises ValueError naming the setting or prompt at fault.
    """
    envs.check()
    check_runner(vllm_config)
    check_model(vllm_config)
    config = RelayConfig.from_vllm(vllm_config.additional_config)
    tools = PromptTools(vllm_config)
    # The block size is final here only if the user chose it: otherwise the engine picks the
    # attention backend's preferred one, and checks prompts against it itself.
    cache = vllm_config.cache_config
    block_size = cache.block_size if cache.user_specified_block_size else None
    return {name: resolve_prompt(name, spec, config, vllm_config, tools, block_size)
            for name, spec in config.system_prompts.items()}


def check_model(vllm_config) -> None:
    """Refuse, before any engine process starts, a model whose attention relay does not serve: MLA's
    latent attention on the CPU (relay extends no CPU MLA backend, and vLLM turns prefix caching off for
    it there). On CUDA relay's MLA backend serves it (attention/mla_backend.py)."""
    if not getattr(vllm_config.model_config, "use_mla", False):
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        raise ValueError("MLA (multi-head latent attention, DeepSeek-V2/V3's) on the CPU: the relay attention "
                         "backend extends vLLM's CPU attention backend, not its MLA one; serve this model without "
                         "--attention-backend relay")


def check_runner(vllm_config) -> None:
    """On GPUs relay runs on Model Runner V2, vLLM's default there: refuse the V1 runner up front
    (the worker would refuse it too, once the model is built). vLLM's CPU runner is not asked."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda_alike() and not vllm_config.use_v2_model_runner:
        raise ValueError("VLLM_USE_V2_MODEL_RUNNER=0: the relay attention backend runs on vLLM's Model Runner V2 "
                         "on GPUs; unset it (or set it to 1)")
