"""Worker hooks on Model Runner V2 (vLLM's runner on GPUs): relay's model state, the step planned
before vLLM picks its CUDA graph, relay's graph manager, a drafter's later passes (hooks/drafter.py) and
the staging of new requests' token ids (hooks/staged_tokens.py).

Applied in the worker when the first relay attention layer is built (`RelayAttentionImpl`), before
vLLM makes the runner's model state; each hook acts only for a relay engine (a relay model state).
"""

from vllm_relay.hooks._patch import original, patch
from vllm_relay.protocol import relay_enabled

_states = _Runner = None


def _resolve_model_state_cls(vllm_config, model):
    cls = original(_states, "resolve_model_state_cls")(vllm_config, model)
    if not relay_enabled(vllm_config):
        return cls
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    if cls is not DefaultModelState:
        raise ValueError(f"vllm-relay serves decoder-only attention models; this model runs vLLM's "
                         f"{cls.__name__} (encoder-decoder, encoder-only, hybrid or its own state)")
    from vllm_relay.attention.model_state import RelayModelState

    return RelayModelState


def _initialize_kv_cache(self, *args, **kwargs):
    result = original(_Runner, "initialize_kv_cache")(self, *args, **kwargs)
    from vllm_relay.attention.model_state import RelayModelState

    if isinstance(self.model_state, RelayModelState):
        if self.cudagraph_manager is not None:
            from vllm_relay.attention.workers import planners
            from vllm_relay.hooks.graphs import multi_token_twins, relay_draft_graphs, relay_graphs

            state = self.model_state
            state.multi_token_graphs = multi_token_twins(self, planners(self.attn_groups))
            relay_graphs(self.cudagraph_manager, state)
            first_pass = getattr(getattr(self, "speculator", None), "prefill_cudagraph_manager", None)
            if first_pass is not None and state.multi_token_graphs:  # a drafter model's first pass
                relay_draft_graphs(first_pass, state)
        from vllm_relay.hooks import drafter, staged_tokens

        drafter.attach(self)  # a drafter of several tokens a step: its later passes on relay
        staged_tokens.install(self.req_states)  # n samples' equal token lists converted once a step
    return result


def _gather_batch_req_state(self, scheduler_output, dummy_run):
    batch, uniform = original(_Runner, "gather_batch_req_state")(self, scheduler_output, dummy_run)
    plan = getattr(self.model_state, "plan", None)
    if plan is not None:  # a relay model state
        groups = getattr(self, "attn_groups", ())  # made with the KV cache: none in the profiling run before
        plan(None if dummy_run else scheduler_output, batch, self.req_states, groups)
    return batch, uniform


def apply_worker() -> None:
    global _states, _Runner
    import vllm.v1.worker.gpu.model_states as states
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm_relay.hooks.runner import apply_worker_stats

    _states, _Runner = states, GPUModelRunner
    patch(states, "resolve_model_state_cls", _resolve_model_state_cls)
    patch(GPUModelRunner, "initialize_kv_cache", _initialize_kv_cache)
    patch(GPUModelRunner, "gather_batch_req_state", _gather_batch_req_state)
    apply_worker_stats()
