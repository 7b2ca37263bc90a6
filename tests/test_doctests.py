"""Every example in vllm_relay's docstrings runs and shows what it says (`doctest`); examples that
only show a call's shape are marked `+SKIP` where they stand."""

import doctest
import importlib
import pkgutil

import pytest

import vllm_relay


# Modules that subclass what only vLLM's CUDA build has (its FLASH_ATTN_MLA backend): left out where the
# vLLM installed cannot import that (its CPU build).
CUDA_BUILD_ONLY = {"vllm_relay.attention.mla_backend"}


def importable(name: str) -> bool:
    if name not in CUDA_BUILD_ONLY:
        return True
    try:
        importlib.import_module(name)
    except ImportError:
        import torch

        assert not torch.cuda.is_available(), f"{name} does not import with CUDA present"
        return False
    return True


def modules_with_examples() -> list[str]:
    """The modules with an example to run (not only `+SKIP` ones)."""
    names = [m.name for m in pkgutil.walk_packages(vllm_relay.__path__, "vllm_relay.") if importable(m.name)]
    finder = doctest.DocTestFinder()

    def runs(t):
        return any(not ex.options.get(doctest.SKIP, False) for ex in t.examples)

    return [n for n in names if any(runs(t) for t in finder.find(importlib.import_module(n)))]


MODULES = modules_with_examples()


def test_the_examples_are_found():
    assert {"vllm_relay.attention.rules", "vllm_relay.ops.joint", "vllm_relay.ops.split_schedule"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS, verbose=False)
    assert result.failed == 0 and result.attempted > 0, result
