import os

import pytest

from tests import triton_interpreter

triton_interpreter.fix()


def pytest_collection_finish(session):
    """TRITON_INTERPRET, which tests/ops sets while its modules are collected (its kernels run in
    Triton's interpreter there), must not reach the engines and servers other tests start: their
    workers would run relay's planner kernels interpreted, where vLLM on a CPU runs the torch twins.
    tests/ops puts it back for its own tests."""
    os.environ.pop("TRITON_INTERPRET", None)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def relay_server():
    """A relay OpenAI server of the tiny model (or VLLM_RELAY_TEST_SERVER), shared by the session."""
    from tests.entrypoints.server import relay_server as serve

    with serve() as server:
        yield server
