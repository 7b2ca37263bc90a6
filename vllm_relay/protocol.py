"""How the engine core tells the workers which requests use relay attention.

The engine core (vllm_relay.hooks.engine) strips a matched system prompt from a request and tags
its `SamplingParams.extra_args`; the workers (vllm_relay.hooks.runner and the attention backends)
read the tag. Nothing else crosses the process boundary, so workers hold no registry state.
"""

from dataclasses import dataclass

TAG_KEY = "vllm_relay"


@dataclass(frozen=True, slots=True)
class RelayTag:
    """`fill`: the request computes system prompt `slot` (its K/V are captured into the store).
    Otherwise the request's own tokens follow system prompt `slot` of `system_len` tokens: its
    positions are shifted by `system_len` and its attention includes the slot's system K/V."""

    slot: int
    system_len: int
    fill: bool = False


def tag(extra_args: dict | None, t: RelayTag) -> dict:
    args = dict(extra_args or {})
    args[TAG_KEY] = {"slot": t.slot, "system_len": t.system_len, "fill": t.fill}
    return args


def read_tag(sampling_params) -> RelayTag | None:
    extra = getattr(sampling_params, "extra_args", None)
    raw = extra.get(TAG_KEY) if extra else None
    return None if raw is None else RelayTag(raw["slot"], raw["system_len"], raw["fill"])


def relay_enabled(vllm_config) -> bool:
    """Relay was asked for: `--attention-backend relay` (which selects CUSTOM, resolved to us)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_relay import RELAY_BACKEND

    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return backend == AttentionBackendEnum.CUSTOM and AttentionBackendEnum.CUSTOM.get_path() == RELAY_BACKEND
