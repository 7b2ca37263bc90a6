"""Front-end hook: a prompt that goes to the engine core again right after itself is sent once.

vLLM fans `SamplingParams(n=...)` out in the front end: n child requests, shallow copies sharing one
prompt list, each sent to the engine core serialized with its own copy of the prompt ids and decoded
there into new Python ints. At 16,000 tokens that is 0.06 ms to encode and 0.48 ms to decode a child on
this project's CPU machine (0.10 ms with no prompt): about 0.1 s for n=256, in the engine core's input
thread, which holds the GIL the engine loop needs.

For a relay engine, `_send_input` of vLLM's multiprocess clients (`SyncMPClient` for `LLM`,
`AsyncMPClient` and its data-parallel subclasses for the server) sends an ADD whose prompt is the very
list object it sent that engine last (at least `MIN_TOKENS` ids) as a reference: no prompt ids, and the
mark of `protocol.mark_same_prompt` in its sampling parameters' `extra_args`. The engine core puts the
previous request's prompt back before anything reads the request (`engine/core.py`, `preprocess`), so
vLLM sees the request exactly as sent; ZMQ keeps one client's messages to one engine in order. A mark
that arrives from a user's `vllm_xargs` is dropped here, before it could make the engine core give a
request another request's prompt. The in-process client (`VLLM_ENABLE_V1_MULTIPROCESSING=0`)
serializes nothing and is left alone.
"""

import weakref

from vllm_relay.hooks._patch import original, patch
from vllm_relay.protocol import (
    SAME_PROMPT_KEY,
    is_same_prompt,
    mark_same_prompt,
    relay_enabled,
    strip_same_prompt_mark,
)

# At 512 ids a reference saves about 5 us of decoding for some 2 us of marking and resolving it (the CPU
# machine: 14.4 us to decode such a request, 9.0 us marked, 1.1 us to mark); shorter prompts gain nothing.
MIN_TOKENS = 512

_Sync = _Async = None
_last_sent: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # client -> {engine: prompt list}
sent_once = 0  # requests this process sent as a reference to the prompt before them


def outgoing(client, request, engine):
    """The request to send in place of `request` (an EngineCoreRequest for `engine`)."""
    global sent_once
    if is_same_prompt(request):
        from vllm.logger import init_logger

        request = strip_same_prompt_mark(request)  # a user's vllm_xargs: never a reference
        init_logger(__name__).warning_once("vllm-relay: dropped the %r key of a request's extra_args "
                                           "(vllm_xargs): only relay's front end sets it", SAME_PROMPT_KEY)
    last = _last_sent.setdefault(client, {})
    prompt = request.prompt_token_ids
    if (prompt is None or len(prompt) < MIN_TOKENS or request.prompt_embeds is not None
            or request.mm_features or request.sampling_params is None):
        last.pop(engine, None)
        return request
    if last.get(engine) is prompt:
        sent_once += 1
        return mark_same_prompt(request)
    last[engine] = prompt
    return request


def _sync_send_input(self, request_type, request):
    from vllm.v1.engine import EngineCoreRequestType

    if request_type == EngineCoreRequestType.ADD and relay_enabled(self.vllm_config):
        request = outgoing(self, request, self.core_engine)
    return original(_Sync, "_send_input")(self, request_type, request)


def _async_send_input(self, request_type, request, engine=None):
    from vllm.v1.engine import EngineCoreRequestType

    if request_type == EngineCoreRequestType.ADD and relay_enabled(self.vllm_config):
        request = outgoing(self, request, self.core_engine if engine is None else engine)
    return original(_Async, "_send_input")(self, request_type, request, engine)


def apply() -> None:
    global _Sync, _Async
    from vllm.v1.engine.core_client import AsyncMPClient, SyncMPClient

    _Sync, _Async = SyncMPClient, AsyncMPClient
    patch(SyncMPClient, "_send_input", _sync_send_input)
    patch(AsyncMPClient, "_send_input", _async_send_input)
