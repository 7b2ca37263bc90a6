"""What relay's processes tell each other about a request, in its `SamplingParams.extra_args`.

The engine core (vllm_relay.hooks.engine) strips a matched system prompt from a request and tags
its `SamplingParams.extra_args`; the workers (vllm_relay.hooks.runner and the attention backends)
read the tag. Nothing else crosses the process boundary, so workers hold no registry state.

The front end (vllm_relay.hooks.transport) sends a request whose prompt is the one it sent last as a
reference: no prompt ids, marked (`mark_same_prompt`); the engine core puts the prompt back
(`resolve_same_prompt`) before anything else reads the request.
"""

import copy
from dataclasses import dataclass

TAG_KEY = "vllm_relay"
SAME_PROMPT_KEY = "vllm_relay_same_prompt"  # value: whether extra_args was None before the mark


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


def mark_same_prompt(request):
    """A copy of EngineCoreRequest `request` without its prompt ids, marked: its prompt is the previous
    request's of the same client."""
    import msgspec

    params = copy.copy(request.sampling_params)
    params.extra_args = {**(params.extra_args or {}), SAME_PROMPT_KEY: params.extra_args is None}
    return msgspec.structs.replace(request, prompt_token_ids=None, sampling_params=params)


def _unmarked(params):
    params = copy.copy(params)
    extra = dict(params.extra_args)
    was_none = extra.pop(SAME_PROMPT_KEY)
    params.extra_args = None if was_none is True and not extra else extra
    return params


def strip_same_prompt_mark(request):
    """A copy of `request` without the mark (as it was before `mark_same_prompt`, prompt aside)."""
    import msgspec

    return msgspec.structs.replace(request, sampling_params=_unmarked(request.sampling_params))


def is_same_prompt(request) -> bool:
    params = request.sampling_params
    return params is not None and bool(params.extra_args) and SAME_PROMPT_KEY in params.extra_args


def resolve_same_prompt(request, prompt: list[int]):
    """`request` (marked) with `prompt` back and the mark removed: the request its front end had."""
    import msgspec

    return msgspec.structs.replace(request, prompt_token_ids=prompt,
                                   sampling_params=_unmarked(request.sampling_params))
