"""Front-end hook: check the relay configuration before any engine process starts.

`EngineArgs.create_engine_config` is where every front end (`vllm.LLM`, `AsyncLLM.from_engine_args`,
`vllm serve` with one or many API servers) turns the user's arguments into a VllmConfig, in the
front end's process, before it launches an engine core. When that config selects relay, we run
`vllm_relay.validate.validate_engine_config` on it: keys, limits, the prompts file, each prompt
tokenized with the model's tokenizer and chat template and checked against max_prompt_tokens,
the vocabulary and max_model_len. A bad configuration then fails in seconds with the message the
engine core would give only after loading the model, profiling memory and warming up. It also
names relay's scheduler class in the config (`vllm_relay.engine.scheduler.select`, which refuses a
user's own `--scheduler-cls`) and turns on this process's bounded detokenizer priming
(`hooks/detokenizer.py`).
"""

from vllm_relay.hooks._patch import original, patch
from vllm_relay.protocol import relay_enabled

_EngineArgs = None


def _create_engine_config(self, *args, **kwargs):
    vllm_config = original(_EngineArgs, "create_engine_config")(self, *args, **kwargs)
    if relay_enabled(vllm_config):
        from vllm_relay.engine import scheduler
        from vllm_relay.hooks import detokenizer
        from vllm_relay.validate import validate_engine_config

        scheduler.select(vllm_config)  # relay's scheduler class; a user's own is refused here
        select_drafter_backend(vllm_config)
        validate_engine_config(vllm_config)
        detokenizer.enable()
    return vllm_config


def select_drafter_backend(vllm_config) -> None:
    """An EAGLE drafter's layers on relay too: vLLM picks a drafter's attention backend on its own
    unless `speculative_config.attention_backend` names one, and a drafter layer of a relay request
    must read the system prompt's pages as the target's layers do. A backend the user named for the
    drafter, other than relay, is refused."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    spec = vllm_config.speculative_config
    if spec is None or not spec.use_eagle():
        return
    if spec.attention_backend is None:
        spec.attention_backend = AttentionBackendEnum.CUSTOM
    elif spec.attention_backend != AttentionBackendEnum.CUSTOM:
        raise ValueError(
            f"speculative_config.attention_backend={spec.attention_backend.name}: with the relay attention "
            "backend the drafter's layers run on relay too (they read the system prompts' pages); leave it "
            "unset")


def apply() -> None:
    global _EngineArgs
    from vllm.engine.arg_utils import EngineArgs

    _EngineArgs = EngineArgs
    patch(EngineArgs, "create_engine_config", _create_engine_config)
