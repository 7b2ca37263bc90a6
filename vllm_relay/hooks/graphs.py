"""Full CUDA graphs per decode size: vLLM's own, and twins that also run the shared levels.

Imported in workers only (with the runner hooks). A full CUDA graph replays a fixed list of launches.
Captured with the levels' launches, it costs every step that replays it those launches, rows or not (on
the H200, 13-14 us a layer at 256 requests on a Llama-7B shape: 5% for traffic that shares nothing);
captured without them, no step can use levels. So relay captures both kinds of each FULL decode graph
vLLM keys, and picks one per step: the planner finds the step's levels right after its inputs are
prepared (`attention.step`), before vLLM dispatches, and the dispatcher returns the levels' twin of the
graph only for a step that has levels. A step without them replays exactly vLLM's graph (attention
reading the context tables relay writes, which are vLLM's own tables when nothing is shared).

The twin is a subclass of vLLM's `BatchDescriptor` with fields of its own: it never equals vLLM's
descriptor, so vLLM's CUDA-graph wrappers keep a graph for each, and everything else vLLM does with
descriptors (padding, `replace`) carries it along.

Each size has a third graph (unless VLLM_RELAY_UNSPLIT_GRAPHS=0): the twin with its joint call captured
unsplit (`relay_unsplit`). Captured split (FlashAttention-3's split count is fixed at capture), the
call launches FA3's combine over all its sequences every step, also on the steps the planner runs
unsplit (`ops.force_one_split`): 80 us a layer, against 19 for vLLM's own graphs (Llama-2-7B shape,
P=8192, H200, 2026-11-28: benchmarks/results/2026-11-28_0906_h200/). The unsplit twin runs the same
tiles without it, and is chosen only for those steps (`attention.workers.step_runs_unsplit`, the
planner's own rule), so no step loses a split it would have had. Measured against the split twin
alone in one job (H200, 2026-11-28: benchmarks/results/2026-11-28_1337_h200/): +0.9% throughput at
P=8192 and +1.5% at P=2048, for 0.12 GiB more graph memory (48 fewer KV tokens of 232,625) and one
more second of capture.

vLLM sizes the KV cache after estimating its graphs' memory: it captures a mode's first two graphs
of the capture list (largest first), the first for the pool it holds and the second for what each
further graph adds. A twin holds more than vLLM's graph of its size (the levels' buffers and
FlashAttention-3's split workspace for every level row the graph can hold), so each size's twin is
listed, and captured, first: the estimate's first graph is then the largest, and its second (vLLM's
graph of that size) never counts a twin's buffers again for every further graph. The smaller twins
still add more than vLLM's graph does, so the estimate falls short (Llama-3-8B shape, graphs up to
1024, H100: 2.51 GiB estimated, 3.74 GiB taken; before, with no twins in it, 0.59 GiB). The twins must
be keyed by then: the relay builder applies these hooks when vLLM first asks it for its CUDA-graph
support, before any keying.
"""

from dataclasses import dataclass, fields

from vllm.forward_context import BatchDescriptor

from vllm_relay import envs
from vllm_relay.hooks._patch import original, patch
from vllm_relay.protocol import relay_enabled

_Dispatcher = _GPUModelRunner = None


@dataclass(frozen=True)
class RelayLevelsDescriptor(BatchDescriptor):
    """The `BatchDescriptor` of a full CUDA graph that also runs the shared levels (`relay_unsplit`:
    their joint call captured unsplit)."""

    relay_levels: bool = True
    relay_unsplit: bool = False


def levels_twin(desc, unsplit: bool = False) -> RelayLevelsDescriptor:
    """The descriptor of `desc`'s graph that also runs the levels (`unsplit`: its unsplit twin)."""
    return RelayLevelsDescriptor(**{f.name: getattr(desc, f.name) for f in fields(BatchDescriptor)},
                                 relay_unsplit=unsplit)


def _rank(d) -> int:
    """A size's graphs in capture order, highest first: the split twin, vLLM's, the unsplit twin."""
    if not isinstance(d, RelayLevelsDescriptor):
        return 1
    return 0 if d.relay_unsplit else 2


def _initialize_cudagraph_keys(self, cudagraph_mode, *args, **kwargs):
    original(_Dispatcher, "initialize_cudagraph_keys")(self, cudagraph_mode, *args, **kwargs)
    if relay_enabled(self.vllm_config):
        from vllm.config import CUDAGraphMode

        full = self.cudagraph_keys[CUDAGraphMode.FULL]
        twins = (False,) if envs.VLLM_RELAY_UNSPLIT_GRAPHS == 0 else (False, True)
        full |= {levels_twin(d, unsplit) for d in full for unsplit in twins}


def _dispatch(self, *args, **kwargs):
    mode, desc = original(_Dispatcher, "dispatch")(self, *args, **kwargs)
    if relay_enabled(self.vllm_config):
        from vllm.config import CUDAGraphMode

        from vllm_relay.attention import step

        full = mode == CUDAGraphMode.FULL
        if full and step.wants_levels():
            keys = self.cudagraph_keys[CUDAGraphMode.FULL]
            unsplit = levels_twin(desc, True)
            twin = unsplit if unsplit in keys and _runs_unsplit(desc.num_tokens) else levels_twin(desc)
            if twin in keys:
                desc = twin
        levels = isinstance(desc, RelayLevelsDescriptor)
        step.dispatched(full, levels, levels and desc.relay_unsplit)
    return mode, desc


def _runs_unsplit(num_tokens: int) -> bool:
    """Whether the graph with levels about to be chosen is the unsplit twin: capturing it, or the step
    runs its joint call unsplit (the planner's rule; every step with VLLM_RELAY_UNSPLIT_GRAPHS=2)."""
    from vllm_relay.attention import step
    from vllm_relay.attention.workers import step_runs_unsplit

    running = step.running()
    if running is None:
        return step.capturing_unsplit()
    return envs.VLLM_RELAY_UNSPLIT_GRAPHS == 2 or step_runs_unsplit(running, num_tokens)


def _get_capture_descs(self):
    descs = original(_Dispatcher, "get_capture_descs")(self)
    if not relay_enabled(self.vllm_config):
        return descs
    order = lambda d: (d.num_tokens, d.num_active_loras, _rank(d))  # noqa: E731
    return [(mode, sorted(batch, key=order, reverse=True)) for mode, batch in descs]


def _warmup_and_capture(self, desc, *args, **kwargs):
    from vllm_relay.attention import step

    twin = isinstance(desc, RelayLevelsDescriptor)
    with step.capturing(twin, twin and desc.relay_unsplit):
        return original(_GPUModelRunner, "_warmup_and_capture")(self, desc, *args, **kwargs)


def apply_worker() -> None:
    """Workers only (with the runner hooks): the dispatcher lives in the model runner."""
    global _Dispatcher, _GPUModelRunner
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _Dispatcher, _GPUModelRunner = CudagraphDispatcher, GPUModelRunner
    patch(CudagraphDispatcher, "initialize_cudagraph_keys", _initialize_cudagraph_keys)
    patch(CudagraphDispatcher, "dispatch", _dispatch)
    patch(CudagraphDispatcher, "get_capture_descs", _get_capture_descs)
    patch(GPUModelRunner, "_warmup_and_capture", _warmup_and_capture)
