"""Worker hooks on vLLM's V1 model runner, which vLLM's CPU build runs: relay requests' positions and
the step's relay facts. (On GPUs relay runs on Model Runner V2: hooks/model_runner.py.)"""

from vllm_relay.hooks._patch import original, patch, swap
from vllm_relay.protocol import relay_enabled


def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
    result = original(_GPUModelRunner, "_prepare_inputs")(self, scheduler_output, num_scheduled_tokens)
    if relay_enabled(self.vllm_config):
        from vllm_relay.attention import step, workers

        relay = getattr(self, "_relay", None)
        if relay is None:  # this runner's slot pages and choice, made once
            from vllm_relay.config import RelayConfig

            cfg = RelayConfig.from_vllm(self.vllm_config.additional_config)
            groups = len(self.kv_cache_config.kv_cache_groups)
            relay = (step.SlotPages.for_config(cfg, self.cache_config.block_size, groups),
                     cfg.auto_levels and cfg.shared_path != "never")
            swap(self, "_relay", relay)
        pages, auto_levels = relay
        found = workers.planners(self.attn_groups)
        level = workers.level_planner(found)
        found += workers.drafter_planners(self)
        current = step.prepare(self, num_scheduled_tokens, pages, self.cache_config.block_size,
                               -1 if level is None else level.kv_group, auto_levels)
        for planner in found:  # the step, for the builders (until it ends: `_execute_model`)
            planner.current = current
        if current is not None and level is not None:
            level.levels_for(current)
    return result


def _relay_worker_stats(self) -> dict:
    """What this worker's relay planners did (`attention.workers.worker_stats`), for the engine
    core's `collective_rpc("relay_worker_stats")`."""
    from vllm_relay.attention.workers import worker_stats

    return worker_stats(self)


def _end_step(runner) -> None:
    """Take the step back from every planner: dummy and profiling runs never see it."""
    if relay_enabled(runner.vllm_config):
        from vllm_relay.attention import workers

        for planner in workers.planners(runner.attn_groups) + workers.drafter_planners(runner):
            planner.current = None


def _execute_model(self, *args, **kwargs):
    deferred = False
    try:
        out = original(_GPUModelRunner, "execute_model")(self, *args, **kwargs)
        deferred = out is None  # sampling and the drafter's forward follow in `sample_tokens`
        return out
    finally:
        if not deferred:
            _end_step(self)


def _sample_tokens(self, *args, **kwargs):
    try:
        return original(_GPUModelRunner, "sample_tokens")(self, *args, **kwargs)
    finally:
        _end_step(self)


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
    patch(GPUModelRunner, "sample_tokens", _sample_tokens)
    apply_worker_stats()
