"""Relay's decode CUDA graphs cover every decode batch the scheduler can form.

vLLM (0.26 to 0.33) captures decode graphs up to `min(2 * max_num_seqs, 512)` tokens; on a GPU of 70 GB or
more `max_num_seqs` is 1024, so decode steps of 513-1024 requests run eagerly. vLLM's own backend
loses little there (Llama-3-8B shape, P=2048, 1000 requests on an H200: 43.2 requests/s with graphs
up to 512, 42.5 up to 1024), but an eager relay step launches its per-layer context call, level
call and fusion from Python and waits on the host
(`benchmarks/results/archive/2026-11-26_h200_accounting/`): 52.4 requests/s with graphs up to 512,
73.2 up to 1024, in the same call.

So with relay on, full CUDA graphs in use (without them relay's attention always runs eagerly),
and neither `max_cudagraph_capture_size` nor `cudagraph_capture_sizes` set by the user, the largest
decode graph becomes `max_num_seqs` decode tokens (with speculative tokens), at most
`MAX_GRAPH_TOKENS`, never below vLLM's own choice; vLLM still clamps it to `max_num_batched_tokens`
and builds the size list as always. The user's own setting always wins.
"""

from vllm_relay.hooks._patch import original, patch
from vllm_relay.protocol import relay_enabled

MAX_GRAPH_TOKENS = 1024  # what was measured; beyond it every graph size costs memory and capture time

_VllmConfig = None


def relay_capture_size(max_num_seqs: int, decode_query_len: int) -> int:
    """The largest decode graph relay captures: every decode batch up to MAX_GRAPH_TOKENS, and at
    least vLLM's own default, `min(2 * max_num_seqs * decode_query_len, 512)`. Rounded up to vLLM's
    stride of sizes above 256 (16), so that the largest batch has a graph.

    >>> relay_capture_size(1024, 1), relay_capture_size(256, 1), relay_capture_size(700, 1)
    (1024, 512, 704)
    """
    tokens = max_num_seqs * decode_query_len
    vllm_default = min(tokens * 2, 512)
    return max(vllm_default, min(-(-tokens // 16) * 16, MAX_GRAPH_TOKENS))


def _set_cudagraph_sizes(self):
    comp = self.compilation_config
    mode = comp.cudagraph_mode
    if (relay_enabled(self) and mode is not None and mode.has_full_cudagraphs()
            and comp.max_cudagraph_capture_size is None and comp.cudagraph_capture_sizes is None):
        sched = self.scheduler_config
        # Clamped here as vLLM would, so that vLLM does not warn of truncating a size nobody gave it.
        comp.max_cudagraph_capture_size = min(sched.max_num_batched_tokens, relay_capture_size(
            sched.max_num_seqs, 1 + self.num_speculative_tokens))
    return original(_VllmConfig, "_set_cudagraph_sizes")(self)


def apply() -> None:
    """Every process: the sizes are decided wherever a VllmConfig is built."""
    global _VllmConfig
    from vllm.config.vllm import VllmConfig

    _VllmConfig = VllmConfig
    patch(VllmConfig, "_set_cudagraph_sizes", _set_cudagraph_sizes)
