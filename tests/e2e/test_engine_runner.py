"""The e2e tests' reading of an engine's log: which of relay's kernels vLLM's JIT monitor saw compiled after
the engine's warm-up (the GPU tests assert none)."""

from tests.e2e.engine_runner import relay_compiles_after_warm_up, relay_kernels


def test_relay_kernels_are_found():
    assert {"_gather_rows_kernel", "_window_level_kernel", "_fuse_in_place_kernel", "_combine_kernel",
            "_prefix_block_table_kernel", "_relay_fusion_kernel"} <= relay_kernels()


def test_only_relays_kernels_compiled_after_warm_up_are_named():
    monitor = "WARNING 12-07 03:33:09 [jit_monitor.py:140] Triton kernel JIT compilation during inference: "
    log = "\n".join([
        "(EngineCore pid=1) INFO 12-07 03:33:08 [jit_monitor.py:84] Kernel JIT monitor activated",
        f"(EngineCore pid=1) {monitor}_compute_local_logits_stats_kernel. This causes a latency spike",
        f"(EngineCore pid=1) {monitor}_gather_rows_kernel (constexprs={{BLOCK=4096}}). This causes a latency spike",
    ])
    compiled = relay_compiles_after_warm_up(log)
    assert len(compiled) == 1 and "_gather_rows_kernel (constexprs" in compiled[0]
    assert relay_compiles_after_warm_up(log.splitlines()[0] + "\nRESULT {}") == []
