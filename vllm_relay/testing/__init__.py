"""Local test fixtures: a trained tokenizer and Llama model folders.

``get_model("tiny-llama-gqa")`` returns the path of a folder that
``transformers`` and vLLM load like a hub checkout; see ``models.py``.
Importing this package is cheap: torch and transformers load only on a build.
"""

from vllm_relay.testing.models import MODEL_NAMES, get_model
from vllm_relay.testing.tokenizer import SYSTEM_MESSAGE

__all__ = ["MODEL_NAMES", "SYSTEM_MESSAGE", "get_model"]
