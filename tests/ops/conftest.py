"""Ops tests run Triton kernels through Triton's interpreter on CPU tensors when there is no GPU.

TRITON_INTERPRET must be in the environment before the kernels are decorated and while they run;
setdefault keeps an explicit TRITON_INTERPRET=0 (or 1) from the caller. `relay_fusion_triton`
builds the interpreted kernel on demand if its module was imported before this file ran (as
happens when pytest collects other test folders first).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# tests/conftest.py takes the variable out of the environment once collection is done (the engines
# other tests start run vLLM as a user does); these tests get it back, as it was, while they run.
INTERPRET = os.environ.get("TRITON_INTERPRET")


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    if INTERPRET is not None:
        monkeypatch.setenv("TRITON_INTERPRET", INTERPRET)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
