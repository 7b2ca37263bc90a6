"""Worker hooks on vLLM's V1 model runner, which vLLM's CPU build runs: relay requests' positions and
the step's relay facts. (On GPUs relay runs on Model Runner V2: hooks/model_runner.py.)"""

from vllm_relay.hooks._patch import original, patch, swap
from vllm_relay.protocol import relay_enabled


def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
    result = original(_GPUModelRunner, "_prepare_inputs")(self, scheduler_output, num_scheduled_tokens)
    if relay_enabled(self.vllm_config):
        from vllm_relay.attention import step
        from vllm_relay.config import RelayConfig

        pages = getattr(self, "_relay_pages", None)
        if pages is None:
            cfg = RelayConfig.from_vllm(self.vllm_config.additional_config)
            pages = step.slot_pages_for(cfg, self.cache_config.block_size)
            swap(self, "_relay_pages", pages)
            swap(self, "_relay_auto_levels", cfg.auto_levels and cfg.shared_path != "never")
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


_GPUModelRunner = None


def apply_worker_stats() -> None:
    from vllm.v1.worker.worker_base import WorkerBase

    patch(WorkerBase, "relay_worker_stats", _relay_worker_stats)


def apply_worker() -> None:
    """Workers of vLLM's V1 runner only (the CPU's), called by the relay CPU metadata builders
    (which only workers construct), so that the front end never imports the model runner."""
    global _GPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _GPUModelRunner = GPUModelRunner
    patch(GPUModelRunner, "_prepare_inputs", _prepare_inputs)
    patch(GPUModelRunner, "execute_model", _execute_model)
    apply_worker_stats()
