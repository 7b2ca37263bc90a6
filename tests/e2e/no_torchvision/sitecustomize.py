"""Test-only: lets vLLM import its Qwen2-VL / Qwen2.5-VL models where torchvision is not installed (the
project's CPU stack has none). Active only then.

vLLM 0.32's qwen2_vl.py imports `smart_resize` from transformers' `image_processing_qwen2_vl`, which
imports torchvision; this serves that module from its PIL twin (`image_processing_pil_qwen2_vl`, the
same `smart_resize`). The tests put this folder on PYTHONPATH for the engines of such a model, so that
every process vLLM starts (its model-inspection subprocess, the engine core) gets it.
"""

import importlib.abc
import importlib.util
import os
import sys

_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"


class _PilTwin(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE or not path:
            return None
        twin = os.path.join(list(path)[0], "image_processing_pil_qwen2_vl.py")
        return importlib.util.spec_from_file_location(fullname, twin) if os.path.exists(twin) else None


if importlib.util.find_spec("torchvision") is None:
    sys.meta_path.insert(0, _PilTwin())
