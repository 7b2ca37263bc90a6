"""Tests of benchmarks/, whose scripts are loaded as modules (benchmarks/ is not a package)."""

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str):
    """benchmarks/<name>.py, executed as a module of that name."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
