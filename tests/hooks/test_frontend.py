"""Fail fast: a bad relay configuration stops the server in the front end, before any engine starts.

Before, a system prompt longer than max_prompt_tokens once tokenized (or any spec error found only
after tokenizing) was reported by the engine core after loading the model, profiling memory and
warming up: 40-90 s on the tiny CPU model, minutes for a large model on a GPU. The front end has
the tokenizer and the config, so it checks there (hooks/frontend.py) and exits non-zero in seconds.
How many seconds depends on the machine (mostly vLLM's imports): bench_startup_error.py (in git history)
measures it; this test checks the behaviour only, with a bound that catches a hang.
"""

import json
import subprocess
import sys
import time

from vllm_relay.testing.models import get_model


def test_bad_relay_config_exits_the_server_before_any_engine_starts():
    relay = {"max_prompt_tokens": 256,
             "system_prompts": {"support": {"chat_system": "word " * 300}}}  # 308 tokens once rendered
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", get_model("tiny-llama-gqa"),
           "--attention-backend", "relay", "--max-model-len", "512", "--port", "8419",
           "--additional-config", json.dumps({"relay": relay})]
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)  # a hang, not a slow machine
    elapsed = time.monotonic() - start
    log = proc.stdout + proc.stderr
    print(f"bad relay config: exit code {proc.returncode} after {elapsed:.1f} s")
    assert proc.returncode != 0, log[-3000:]
    assert "ValueError: system prompt 'support': 308 tokens, more than max_prompt_tokens=256" in log, log[-3000:]
    assert "EngineCore" not in log and "Loading weights" not in log, log[-3000:]  # no engine was started


def test_frontend_hook_validates_only_relay_engines():
    from vllm.engine.arg_utils import EngineArgs

    import vllm_relay
    from vllm_relay import hooks

    vllm_relay.register()
    assert "EngineArgs.create_engine_config" in hooks.applied_patches()
    bad = {"relay": {"max_prompt_tokens": 256, "system_prompts": {"a": "word " * 400}}}
    model = get_model("tiny-llama-gqa")
    EngineArgs(model=model, max_model_len=512, additional_config=bad).create_engine_config()  # not relay
    try:
        EngineArgs(model=model, max_model_len=512, block_size=16, attention_backend="relay",
                   additional_config=bad).create_engine_config()
    except ValueError as e:
        assert "system prompt 'a': 402 tokens, more than max_prompt_tokens=256" in str(e)
    else:
        raise AssertionError("a relay engine with a too-long prompt was configured")


def test_frontend_hook_names_relay_scheduler_only_for_relay_engines():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler

    import vllm_relay
    from vllm_relay.engine.scheduler import RelayScheduler

    vllm_relay.register()
    model = get_model("tiny-llama-gqa")
    plain = EngineArgs(model=model, max_model_len=512).create_engine_config().scheduler_config
    assert plain.scheduler_cls is None and plain.get_scheduler_cls() is Scheduler  # inert
    relay = EngineArgs(model=model, max_model_len=512, block_size=16,
                       attention_backend="relay").create_engine_config().scheduler_config
    assert relay.scheduler_cls == "vllm_relay.engine.scheduler.RelayScheduler"  # async off on the CPU
    assert relay.get_scheduler_cls() is RelayScheduler
    try:
        EngineArgs(model=model, max_model_len=512, block_size=16, attention_backend="relay",
                   scheduler_cls="my_pkg.MyScheduler").create_engine_config()
    except ValueError as e:
        assert str(e).startswith("scheduler_cls='my_pkg.MyScheduler': the relay attention backend runs its "
                                 "own scheduler"), e
    else:
        raise AssertionError("a relay engine with a scheduler class of the user's was configured")
