"""Python's garbage collections as torch-profiler annotations (`gc gen0` .. `gc gen2`), in every process.

A benchmark aid, never installed: `e2e.sh` puts this folder first on PYTHONPATH when GC_TRACE=1, so
the engine core (a spawned process) runs it too, and a profiled run's trace shows each collection on
the host's timeline beside vLLM's scopes (`trace_steps.py --idle-host` then counts it in the steps
whose GPU waited). Torch is never imported here: a collection before the process imported it is
not annotated.
"""

import gc
import sys

_open = []


def _annotate(phase, info):
    torch = sys.modules.get("torch")
    if torch is None or not hasattr(torch, "autograd"):
        return
    try:
        if phase == "start":
            scope = torch.autograd.profiler.record_function(f"gc gen{info.get('generation', '?')}")
            scope.__enter__()
            _open.append(scope)
        elif _open:
            _open.pop().__exit__(None, None, None)
    except Exception:  # a half-imported torch: leave this collection out
        _open.clear()


gc.callbacks.append(_annotate)
