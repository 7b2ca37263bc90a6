"""Worker hooks: relay requests' positions, and the V1 model runner when relay is on.

vLLM runs every model on Model Runner V2 by default (0.32, 0.33); relay shifts positions in the V1
runner's `_prepare_inputs` (also the runner vLLM's CPU build uses), so with relay on, V1 is chosen.
"""

from vllm_relay.hooks._patch import original, patch
from vllm_relay.protocol import relay_enabled

RELAY_V1_REASON = "relay attention (vllm-relay shifts system-prompt positions in the V1 runner)"


def _unsupported_v2_features(self) -> list[str]:
    reasons = original(_VllmConfig, "_get_v2_model_runner_unsupported_features")(self)
    if relay_enabled(self):
        reasons.append(RELAY_V1_REASON)
    return reasons


def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
    result = original(_GPUModelRunner, "_prepare_inputs")(self, scheduler_output, num_scheduled_tokens)
    if relay_enabled(self.vllm_config):
        from vllm_relay.attention import step
        from vllm_relay.config import RelayConfig

        pages = getattr(self, "_relay_pages", None)
        if pages is None:
            cfg = RelayConfig.from_vllm(self.vllm_config.additional_config)
            pages = self._relay_pages = step.slot_pages_for(cfg, self.cache_config.block_size)
            self._relay_auto_levels = cfg.auto_levels and cfg.shared_path != "never"
        step.prepare(self, num_scheduled_tokens, pages, self.cache_config.block_size, self._relay_auto_levels)
        if step._current is not None:
            from vllm_relay.attention.workers import find_step_levels

            find_step_levels(step._current)
    return result


def _relay_worker_stats(self) -> dict:
    """What this worker's relay planners did (`attention.workers.worker_stats`), for the engine
    core's `collective_rpc("relay_worker_stats")`."""
    from vllm_relay.attention.workers import worker_stats

    return worker_stats()


def _execute_model(self, *args, **kwargs):
    try:
        return original(_GPUModelRunner, "execute_model")(self, *args, **kwargs)
    finally:
        from vllm_relay.attention import step

        step.clear()


_VllmConfig = _GPUModelRunner = None


def apply() -> None:
    """Every process: the runner choice is made wherever a VllmConfig is asked for it."""
    global _VllmConfig
    from vllm.config.vllm import VllmConfig

    _VllmConfig = VllmConfig
    patch(VllmConfig, "_get_v2_model_runner_unsupported_features", _unsupported_v2_features)


def apply_worker() -> None:
    """Workers only, called by the relay metadata builders (which only workers construct), so
    that the front end never imports the model runner."""
    global _GPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.worker_base import WorkerBase

    _GPUModelRunner = GPUModelRunner
    patch(GPUModelRunner, "_prepare_inputs", _prepare_inputs)
    patch(GPUModelRunner, "execute_model", _execute_model)
    patch(WorkerBase, "relay_worker_stats", _relay_worker_stats)
    from vllm_relay.hooks import graphs

    graphs.apply_worker()
