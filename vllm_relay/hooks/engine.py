"""Engine-core hooks: route requests to system prompts, hold them while a prompt fills, fill prompts.

Everything here runs in the EngineCore process (or in the front end's process when vLLM runs the
engine in-process). A `RelayEngine` (vllm_relay/engine/core.py) is attached to the EngineCore and its
scheduler at start-up when relay is enabled; each patched vLLM function looks for it and otherwise
runs the original unchanged. The scheduler of a relay engine is relay's subclass of vLLM's
(vllm_relay/engine/scheduler.py, named by `SchedulerConfig.scheduler_cls`), which calls the
RelayEngine from `schedule`, `update_from_output`, `finish_requests` and `_free_request`. The
patches (listed in patches/README.md) only forward to it:

- `EngineCoreProc.run_engine_core`: loads the plugins before the spawned engine core is built,
  so that the `EngineCore.__init__` patch applies to it.
- `EngineCore.__init__`: names relay's scheduler class in the config (`scheduler.select`, for a
  config built without `EngineArgs`) before vLLM builds the scheduler; then attaches the
  RelayEngine, registers and fills the configured prompts.
  It returns before the engine core answers the front end's handshake, so `LLM(...)` returns and
  the server reports healthy only once they are ready.
- `EngineCore.preprocess_add_request`: the one place every request enters (LLM and the OpenAI
  server, in-process and multiprocess): routes it (`RelayEngine.preprocess`).
- `EngineCore.add_request` / `abort_requests`: hold requests for a filling prompt; after an
  abort, apply fill outcomes (an aborted fill fails its prompt and releases its held requests).
- `EngineCore.reset_prefix_cache` / `collective_rpc`: after a prefix-cache reset (RL loops,
  pause(clear_cache=True), sleep) or a weight update the workers ran, fill every system prompt
  again through the current weights (engine/refills.py).
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_relay.engine.refills import WEIGHT_UPDATES
from vllm_relay.engine.requests import ENGINE_ATTR
from vllm_relay.hooks._patch import original, patch
from vllm_relay.protocol import relay_enabled

# ---- patches: forward to the RelayEngine when there is one, else run vLLM's code ------------

_EngineCore: Any = None
_EngineCoreProc: Any = None


def _run_engine_core(*args, **kwargs):
    # This function is what a spawned engine-core process unpickles and runs, before any plugin is
    # loaded there: load them (idempotent; vLLM does it again inside EngineCore.__init__, too late
    # for the patch of that same __init__), then run vLLM's own entry point.
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.engine.core import EngineCoreProc

    # Before plugins load here, CUSTOM cannot yet resolve to us: the member alone is the signal.
    config = kwargs.get("vllm_config")
    if getattr(getattr(config, "attention_config", None), "backend", None) == AttentionBackendEnum.CUSTOM:
        load_general_plugins()
    return original(EngineCoreProc, "run_engine_core")(*args, **kwargs)


def _engine_core_init(self, vllm_config, *args, **kwargs):
    relay = relay_enabled(vllm_config)
    if relay:
        from vllm_relay.engine import scheduler

        # Before vLLM builds the scheduler: relay's class (the front end already named it in
        # configs built by EngineArgs; this covers the others).
        scheduler.select(vllm_config)
    original(_EngineCore, "__init__")(self, vllm_config, *args, **kwargs)
    if relay:
        from vllm_relay.engine import RelayEngine

        RelayEngine.attach(self)


def _preprocess_add_request(self, request):
    relay = getattr(self, ENGINE_ATTR, None)
    if relay is None:
        return original(_EngineCore, "preprocess_add_request")(self, request)
    return relay.preprocess(request)


def _add_request(self, request, request_wave: int = 0):
    relay = getattr(self, ENGINE_ATTR, None)
    if relay is None:
        return original(_EngineCore, "add_request")(self, request, request_wave)
    relay.add(request, request_wave)


def _abort_requests(self, request_ids):
    original(_EngineCore, "abort_requests")(self, request_ids)
    relay = getattr(self, ENGINE_ATTR, None)
    if relay is not None:
        relay.fills.finish()  # an aborted fill fails its prompt and frees the requests it held


def _reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
    relay = getattr(self, ENGINE_ATTR, None)
    reset = functools.partial(original(_EngineCore, "reset_prefix_cache"), self)
    if relay is None:
        return reset(reset_running_requests, reset_connector)
    return relay.refills.reset_prefix_cache(reset, reset_running_requests, reset_connector)


def _collective_rpc(self, method, timeout=None, args=(), kwargs=None):
    result = original(_EngineCore, "collective_rpc")(self, method, timeout, args, kwargs)
    relay = getattr(self, ENGINE_ATTR, None)
    if relay is not None and isinstance(method, str) and method in WEIGHT_UPDATES:
        relay.refills.weights_updated(method)
    return result


def apply() -> None:
    global _EngineCore, _EngineCoreProc
    from vllm.v1.engine.core import EngineCore, EngineCoreProc

    _EngineCore, _EngineCoreProc = EngineCore, EngineCoreProc
    patch(EngineCoreProc, "run_engine_core", staticmethod(_run_engine_core))
    patch(EngineCore, "__init__", _engine_core_init)
    patch(EngineCore, "preprocess_add_request", _preprocess_add_request)
    patch(EngineCore, "add_request", _add_request)
    patch(EngineCore, "abort_requests", _abort_requests)
    patch(EngineCore, "reset_prefix_cache", _reset_prefix_cache)
    patch(EngineCore, "collective_rpc", _collective_rpc)
