"""What the engine core knows about the requests it routes: eligibility, copies, the tag on vLLM's Request.

Pure helpers over vLLM's request structs; the RelayEngine (engine/core.py) uses them, and the
hooks (hooks/engine.py) only forward to it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import msgspec

from vllm_relay.protocol import TAG_KEY, RelayTag, is_same_prompt, resolve_same_prompt, tag
from vllm_relay.system_prompts import SystemPrompt
from vllm_relay.system_prompts.fill import relay_salt

# Attribute names on vLLM objects: the RelayEngine on EngineCore and Scheduler, per-request
# info on Request.
ENGINE_ATTR = "vllm_relay"
INFO_ATTR = "_vllm_relay"


@dataclass(slots=True)
class RelayInfo:
    """What the engine core knows about a request it tagged (kept on vLLM's Request)."""

    prompt: SystemPrompt
    fill: bool = False
    # Matched a prompt that is still filling: waits in the engine core until it is ready.
    held: bool = False
    # A held request keeps the request as sent, to run it the ordinary way if the fill fails.
    original: Any = None
    # Holds one reference on `prompt`, released exactly once, when the request is freed.
    acquired: bool = False


def relay_eligible(request) -> bool:
    """Whether an EngineCoreRequest may be routed: a plain generate request over token ids.

    Not routed: prompt embeddings, multimodal inputs, LoRA (its KV differs), pooling, prompt
    logprobs (they would be needed for the system tokens), a repetition penalty (vLLM applies it
    to prompt tokens too, and the workers would see only the suffix), streaming-input sessions, requests
    aborted on arrival, KV/encoder transfer (P/D: the transferred KV would lack the system part).
    """
    sp = request.sampling_params
    extra = (sp.extra_args or {}) if sp is not None else {}
    return (
        sp is not None
        and request.prompt_token_ids is not None
        and request.prompt_embeds is None
        and request.prompt_is_token_ids is None
        and not request.mm_features
        and request.lora_request is None
        and request.pooling_params is None
        and sp.prompt_logprobs is None
        and sp.repetition_penalty == 1.0
        and not request.resumable
        and not request.abort_immediately
        and "kv_transfer_params" not in extra
        and "ec_transfer_params" not in extra
    )


def with_sampling(request, sampling_params, **changes):
    """A copy of an EngineCoreRequest with other sampling params (and fields); never mutates."""
    return msgspec.structs.replace(request, sampling_params=sampling_params, **changes)


class SentPrompts:
    """The prompt each front-end client sent last (by `client_index`): what a request that its front end
    sent as a reference to it (`hooks/transport.py`) stands for. Used on the engine core's input thread
    only, where requests arrive in each client's order."""

    def __init__(self) -> None:
        self._last: dict[int, list[int]] = {}

    def resolve(self, request):
        """`request` as its front end had it: a reference gets the client's last prompt back."""
        if not is_same_prompt(request):
            if request.prompt_token_ids is None:
                self._last.pop(request.client_index, None)
            else:
                self._last[request.client_index] = request.prompt_token_ids
            return request
        prompt = self._last.get(request.client_index)
        if prompt is None or request.prompt_token_ids is not None:
            raise ValueError(f"vllm-relay: request {request.request_id} was sent as a reference to the previous "
                             f"request's prompt of client {request.client_index}, which this engine core did not "
                             "receive (a front end without relay's hooks, or an engine core restarted between them)")
        return resolve_same_prompt(request, prompt)


def strip_forged_tag(request):
    """Drop a relay tag sent by a client (e.g. through vllm_xargs): only the engine core tags.

    A forged tag would make the workers shift positions, read a slot, or overwrite one (fill).
    """
    sp = request.sampling_params
    if sp is None or not sp.extra_args or TAG_KEY not in sp.extra_args:
        return request
    sp = copy.copy(sp)
    sp.extra_args = {k: v for k, v in sp.extra_args.items() if k != TAG_KEY} or None
    return with_sampling(request, sp)


def rewrite(request, prompt: SystemPrompt, relay_len: int, max_model_len: int, secret: str):
    """The request as the scheduler sees it: its own tokens (without the `relay_len` tokens it
    reads from `prompt`'s pages), a relay tag, a relay salt (made with the engine's `secret`).

    max_tokens is capped where the full prompt would reach max_model_len: the scheduler
    sees only the suffix, so it cannot apply that cap itself.
    """
    S, full_len = relay_len, len(request.prompt_token_ids)
    sp = copy.copy(request.sampling_params)
    sp.extra_args = tag(sp.extra_args, RelayTag(prompt.slot, S))
    if sp.max_tokens is not None:
        sp.max_tokens = max(1, min(sp.max_tokens, max_model_len - full_len))
    return with_sampling(
        request, sp,
        prompt_token_ids=request.prompt_token_ids[S:],
        cache_salt=relay_salt(prompt, request.cache_salt, secret),
    )
