"""Full CUDA graphs per decode size on Model Runner V2: vLLM's own, and twins that also run the levels.

A full CUDA graph replays a fixed list of launches. Captured with the levels' launches, it costs every
step that replays it those launches, rows or not (on the H200, 13-14 us a layer at 256 requests on a
Llama-7B shape: 5% for traffic that shares nothing); captured without them, no step can use levels.
So relay captures both kinds of each FULL graph vLLM keys for a decode of one token per request, and
picks one per step:
the relay model state finds the step's levels as soon as vLLM has gathered the batch, before vLLM
picks the graph (`attention/model_state.py`), and the graph manager returns the levels' twin of the
graph only for a step that has levels. A step without them replays exactly vLLM's graph (attention
reading the context tables relay writes, which are vLLM's own tables when nothing is shared).

Under vLLM's default `FULL_AND_PIECEWISE` those are its uniform-decode graphs; steps with a prompt chunk
run piecewise, their attention eager, levels and all. With drafts a decode is 1 + k tokens a request (vLLM
keys those graphs by `uniform_token_count`): their twins hold the levels and the contexts as two calls
(the joint call is for one token a request); only with VLLM_RELAY_VERIFY_GRAPHS=1, for they measured
slower than vLLM's graphs at 64 requests (envs.py). A drafter model's first pass (EAGLE-3, MTP) replays
graphs of its own over the tables the target's step wrote: each of those gets a twin as well, replayed
when the target's step replayed its twin (`RelayDraftGraphs`); with a drafter relay cannot give twins
to, the verification steps replay vLLM's graphs (`multi_token_twins`).

Under `cudagraph_mode=FULL` vLLM has one kind of graph for every batch up to its largest size, prompt
chunks too (host-bound steps, such as a lone chat request's prefill, replay one graph instead of a piece
a layer): each of its graphs of as many requests as tokens gets twins captured as one-token decodes,
replayed for the steps that are such decodes and have levels; a step with a prompt chunk replays vLLM's
graph and reads its system prompt in its context that step (no levels), or runs eagerly with levels past
the largest graph.

The twin is a subclass of vLLM's `BatchExecutionDescriptor` with fields of its own: it never equals
vLLM's descriptor, so vLLM keeps a graph for each, and what vLLM does with descriptors (`replace` for
DP padding) carries it along.

Each size has a third graph (unless VLLM_RELAY_UNSPLIT_GRAPHS=0): the twin with its levels' call (the
joint call, or the levels' own where the contexts are a call of their own: sinks, several tokens a
request) captured unsplit (`relay_unsplit`). Captured split (FlashAttention-3's split count is fixed
at capture), the call launches FA3's combine over all its sequences every step, also on the steps the
planner runs unsplit (`ops.force_one_split`): 80 us a layer, against 19 for vLLM's own graphs
(Llama-2-7B shape, P=8192, H200, 2026-11-28: benchmarks/results/archive/). The unsplit twin runs the
same tiles without it, and is chosen only for those steps (the planner's own rule,
`runs_unsplit`), so no step loses a split it would have had (+0.9% throughput at P=8192 and
+1.5% at P=2048 against the split twin alone, joint calls, H200, 2026-11-28).

vLLM sizes the KV cache after estimating its graphs' memory from the first few FULL graphs of its
capture list (largest first), extrapolated to the rest. A twin holds more than vLLM's graph of its
size (the levels' buffers and FlashAttention-3's split workspace for every level row the graph can
hold), so each size's twin is listed, and captured, first.

How: the runner's graph manager becomes `RelayCudaGraphManager` (hooks/model_runner.py swaps the
class of the instance vLLM made, for relay engines only). Its capture reaches vLLM's through
`_CaptureWithLevels`, placed between vLLM's `ModelCudaGraphManager` and `CudaGraphManager` in the
method order, so the factory vLLM's model manager hands its base class is wrapped to tell the model
state which kind of graph each capture is. A drafter's first-pass manager becomes `RelayDraftGraphs`
the same way (its capture builds the metadata through the target's builders).
"""

from dataclasses import dataclass, fields, replace

from vllm.config import CUDAGraphMode
from vllm.v1.worker.gpu.cudagraph_utils import (
    BatchExecutionDescriptor,
    CudaGraphManager,
    ModelCudaGraphManager,
)
from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils import SpeculatorCudaGraphManager

from vllm_relay import envs
from vllm_relay.hooks._patch import swap


@dataclass(frozen=True)
class RelayLevelsDescriptor(BatchExecutionDescriptor):
    """The descriptor of a full CUDA graph that also runs the shared levels (`relay_unsplit`:
    their joint call captured unsplit)."""

    relay_levels: bool = True
    relay_unsplit: bool = False


def levels_twin(desc, unsplit: bool = False) -> RelayLevelsDescriptor:
    """The descriptor of `desc`'s graph that also runs the levels (`unsplit`: its unsplit twin), captured
    as a decode of `desc`'s tokens a request, one where it has no such count (vLLM's capture reads
    `uniform_token_count` for the dummy batch's query length)."""
    kept = {f.name: getattr(desc, f.name) for f in fields(BatchExecutionDescriptor)}
    return RelayLevelsDescriptor(**{**kept, "uniform_token_count": desc.uniform_token_count or 1},
                                 relay_unsplit=unsplit)


def _rank(d) -> int:
    """A size's graphs in capture order, highest first: the split twin, vLLM's, the unsplit twin."""
    if not isinstance(d, RelayLevelsDescriptor):
        return 1
    return 0 if d.relay_unsplit else 2


def _has_twin(desc, decode_query_len: int = 1, multi_token: bool = False) -> bool:
    """The graphs that get twins: FULL graphs of vLLM's uniform decodes, of one token a request (of
    more, with drafts, where `multi_token`); under `cudagraph_mode=FULL`, its graphs of as many requests
    as tokens, where a decode is one token."""
    if desc.cg_mode != CUDAGraphMode.FULL or desc.num_ubatches != 1:
        return False
    if desc.uniform_token_count is not None:
        return desc.uniform_token_count == 1 or multi_token
    return decode_query_len == 1 and desc.num_reqs == desc.num_tokens and desc.max_query_len in (None, 1)


def multi_token_twins(runner, planners) -> bool:
    """Whether `runner`'s decodes of several tokens a request (drafts verified) get twins: only with
    VLLM_RELAY_VERIFY_GRAPHS=1 (their two calls in a graph measured slower than vLLM's graph at 64
    requests, envs.py); with n-gram drafts, and with a drafter model whose first pass relay gives twins
    too (`RelayDraftGraphs`: vLLM's EAGLE-3 and MTP speculators; another's graphs over the target's
    tables, captured without levels, would read context tables that leave the levels' pages out), where
    every relay planner (`planners`) gives such rows levels (an MLA backend's decode form holds so many
    tokens a request)."""
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    spec = getattr(runner, "speculator", None)
    if spec is None or envs.VLLM_RELAY_VERIFY_GRAPHS == 0:
        return False
    if isinstance(spec, DraftModelSpeculator):
        first = getattr(spec, "prefill_cudagraph_manager", None)
        if first is not None and type(first) is not SpeculatorCudaGraphManager:
            return False
    tokens = runner.decode_query_len
    return all(p.max_level_query_len is None or p.max_level_query_len >= tokens for p in planners)


class _CaptureWithLevels(CudaGraphManager):
    def capture(self, create_forward_fn, progress_bar_desc: str = "Capturing CUDA graphs") -> None:
        state = self.relay_state
        state.step = None  # no step is being run: the captures' metadata is built for their dummy batches

        def create(desc, warmup: bool):
            twin = isinstance(desc, RelayLevelsDescriptor)
            state.capturing = (twin, twin and desc.relay_unsplit)
            try:  # the metadata is built here; the forward function only replays it
                return create_forward_fn(desc, warmup)
            finally:
                state.capturing = (False, False)

        super().capture(create, progress_bar_desc)


class RelayCudaGraphManager(ModelCudaGraphManager, _CaptureWithLevels):
    relay_state = None  # the runner's RelayModelState

    def add_level_twins(self) -> None:
        """Key the twins of each FULL graph that can hold a decode (`_has_twin`), captured right beside it."""
        _add_twins(self, self.relay_state.multi_token_graphs, _unsplit_kinds())

    def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len=None,
                 num_ubatches: int = 1):
        desc = super().dispatch(num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len,
                                num_ubatches)
        step = self.relay_state.step if self.relay_state is not None else None
        if step is None:
            return desc
        if (step.tree is not None and uniform_token_count is not None
                and _has_twin(desc, self.decode_query_len, self.relay_state.multi_token_graphs)):
            split = levels_twin(desc)
            if split.uniform_token_count == uniform_token_count:
                planner, twin = self.relay_state.planner, replace(split, relay_unsplit=True)
                if twin not in self.graphs or not _runs_unsplit(planner, step, desc.num_tokens,
                                                                uniform_token_count):
                    twin = split
                if twin in self.graphs:
                    desc = twin
        levels = isinstance(desc, RelayLevelsDescriptor)
        step.graph_levels = levels if desc.cg_mode == CUDAGraphMode.FULL else None
        step.graph_unsplit = levels and desc.relay_unsplit
        return desc


def _add_twins(manager, multi_token: bool, unsplit: tuple) -> None:
    """Key in `manager` the twins of each FULL graph that can hold a decode, each size's graphs in
    capture order: the `unsplit` ones (False, True: both)."""
    full = manager._capture_descs.get(CUDAGraphMode.FULL)
    if not full:
        return
    full = [d for d in full if not isinstance(d, RelayLevelsDescriptor)]
    full += [levels_twin(d, u) for d in full if _has_twin(d, manager.decode_query_len, multi_token)
             for u in unsplit]
    order = lambda d: (d.num_tokens, d.num_active_loras, _rank(d))  # noqa: E731
    manager._capture_descs[CUDAGraphMode.FULL] = sorted(full, key=order, reverse=True)


class RelayDraftGraphs(SpeculatorCudaGraphManager, _CaptureWithLevels):
    """The graphs of a drafter model's first pass (vLLM's EAGLE-3 and MTP speculators' draft prefill),
    which runs the draft layers over the target step's tokens: eagerly on the target's attention
    metadata, or replaying a graph of its own whose attention reads the same persistent tables. Each of
    its verification graphs gets a levels' twin, captured through the target's builders as the target's
    twin is, replayed exactly when the target's step replayed its twin (the context tables then leave
    the levels' pages to the levels); with no such twin captured, the pass runs eagerly on the target's
    metadata."""

    relay_state = None  # the runner's RelayModelState

    def add_level_twins(self) -> None:
        _add_twins(self, True, _unsplit_kinds())

    def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len=None,
                 num_ubatches: int = 1):
        desc = super().dispatch(num_reqs, num_tokens, uniform_token_count, num_active_loras, max_query_len,
                                num_ubatches)
        step = self.relay_state.step
        if desc.cg_mode == CUDAGraphMode.FULL and step is not None and step.graph_levels:
            twin = levels_twin(desc, step.graph_unsplit)  # the kind the target's step replayed
            desc = twin if twin in self.graphs else replace(desc, cg_mode=CUDAGraphMode.NONE)
        return desc


def _unsplit_kinds() -> tuple:
    """The twins each size gets: split, and unsplit unless VLLM_RELAY_UNSPLIT_GRAPHS=0."""
    return (False,) if envs.VLLM_RELAY_UNSPLIT_GRAPHS == 0 else (False, True)


def _runs_unsplit(planner, step, num_tokens: int, tokens_per_request: int = 1) -> bool:
    """Whether the step's levels run unsplit in a graph of `num_tokens` (the planner's rule, asked before
    vLLM picks the graph; every step with levels under VLLM_RELAY_UNSPLIT_GRAPHS=2)."""
    if envs.VLLM_RELAY_UNSPLIT_GRAPHS == 2:
        return True
    return planner is not None and step.tree is not None and planner.runs_unsplit(step.tree, num_tokens,
                                                                                  tokens_per_request)


def relay_graphs(manager, model_state) -> None:
    """Make vLLM's graph manager `manager` relay's (the instance's class swapped), serving `model_state`."""
    if type(manager) is not ModelCudaGraphManager:
        raise RuntimeError(f"vllm-relay: unexpected CUDA graph manager {type(manager).__name__}")
    swap(manager, "__class__", RelayCudaGraphManager)
    swap(manager, "relay_state", model_state)
    manager.add_level_twins()


def relay_draft_graphs(manager, model_state) -> None:
    """Make a drafter model's first-pass graph manager `manager` relay's (`RelayDraftGraphs`), serving
    `model_state`."""
    if type(manager) is not SpeculatorCudaGraphManager:
        raise RuntimeError(f"vllm-relay: unexpected drafter graph manager {type(manager).__name__}")
    swap(manager, "__class__", RelayDraftGraphs)
    swap(manager, "relay_state", model_state)
    manager.add_level_twins()
